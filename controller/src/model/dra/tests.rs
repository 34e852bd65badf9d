use gpu_agent_proto::report::v1 as pb;
use k8s_openapi::api::resource::v1::{Device, ResourceSlice};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;

use super::names::*;
use super::slices::{LOST_TAINT, UNHEALTHY_TAINT, XID_TAINT};
use super::*;

fn gpu(minor: u32) -> GpuFacts {
    GpuFacts {
        minor: Some(minor),
        uuid: format!("GPU-{minor:08x}-0000-0000-0000-000000000000"),
        product_name: Some("NVIDIA H100 80GB HBM3".into()),
        brand: Some("Nvidia".into()),
        architecture: Some("Hopper".into()),
        compute_capability: Some("9.0".into()),
        pci_bus_id: Some(format!("00000000:{:02X}:00.0", 0x18 + minor)),
        pcie_root: Some("pci0000:00".into()),
        numa_node: Some(1),
        memory_bytes: Some(81559 * 1024 * 1024),
        ..Default::default()
    }
}

fn mig(n: u32, profile: &str, gi: u32, start: u32) -> MigFacts {
    MigFacts {
        uuid: format!("MIG-{n:08x}-0000-0000-0000-000000000000"),
        profile: profile.into(),
        gi_profile_id: Some(gi),
        placement_start: Some(start),
        memory_bytes: Some(9856 * 1024 * 1024),
        multiprocessors: Some(16),
        copy_engines: Some(1),
        decoders: Some(1),
        encoders: Some(0),
        jpeg_engines: Some(1),
        ofa_engines: Some(0),
    }
}

fn node(gpus: Vec<GpuFacts>) -> NodeDevices {
    NodeDevices {
        driver_version: Some("580.95.05".into()),
        cuda_driver_version: Some(cuda_version(13000)),
        gpus,
    }
}

fn names_of(devs: &[Device]) -> Vec<&str> {
    devs.iter().map(|d| d.name.as_str()).collect()
}

fn attr<'a>(d: &'a Device, key: &str) -> &'a k8s_openapi::api::resource::v1::DeviceAttribute {
    &d.attributes.as_ref().unwrap()[key]
}

#[test]
fn mig_profiles_named_as_nvidia_does() {
    assert_eq!(profile_label("1g.10gb"), "1g10gb");
    assert_eq!(profile_label("1g.10gb+me"), "1g10gb-me");
    assert_eq!(profile_label("1c.2g.20gb"), "1c2g20gb");
    assert_eq!(profile_label("+1G.10GB+"), "1g10gb");
    assert_eq!(mig_name(0, "1g.10gb", 19, 6), "gpu-0-mig-1g10gb-19-6");
    assert_eq!(mig_name(3, "1g.10gb+me", 20, 0), "gpu-3-mig-1g10gb-me-20-0");
    assert_eq!(gpu_name(7), "gpu-7");
    assert!(is_dns_label("gpu-3-mig-1g10gb-me-20-0"));
    assert!(!is_dns_label("-gpu") && !is_dns_label("Gpu-0") && !is_dns_label(""));
    assert!(!is_dns_label(&"a".repeat(64)));
}

#[test]
fn versions_normalised_to_semver() {
    assert_eq!(semver("580.95.05").as_deref(), Some("580.95.5"));
    assert_eq!(semver("550.127.08").as_deref(), Some("550.127.8"));
    assert_eq!(cuda_version(13000), "13.0");
    assert_eq!(cuda_version(12040), "12.4");
    assert_eq!(semver(&cuda_version(13000)).as_deref(), Some("13.0.0"));
    assert_eq!(semver("9.0").as_deref(), Some("9.0.0"));
    assert_eq!(semver("12").as_deref(), Some("12.0.0"));
    for bad in ["", "1.2.3.4", "v1.2", "1..2", "580.95.05-rc1", "a.b"] {
        assert_eq!(semver(bad), None, "{bad:?}");
    }
}

#[test]
fn pci_addresses_and_quantities_spelled_as_the_api_has_them() {
    assert_eq!(
        pci_bus_id("00000000:3B:00.0").as_deref(),
        Some("0000:3b:00.0")
    );
    assert_eq!(pci_bus_id("0000:18:00.0").as_deref(), Some("0000:18:00.0"));
    assert_eq!(pci_bus_id("3B:00.0"), None);
    assert_eq!(pci_bus_id("100000:3b:00.0"), None);
    assert_eq!(binary_si(81559 * 1024 * 1024), "81559Mi");
    assert_eq!(binary_si(80 << 30), "80Gi");
    assert_eq!(binary_si(1000), "1000");
    assert_eq!(binary_si(0), "0");
    assert_eq!(decimal_si(16), "16");
    assert_eq!(decimal_si(2000), "2k");
    assert_eq!(decimal_si(0), "0");
}

#[test]
fn slice_names_fixed_and_within_a_dns_subdomain() {
    assert_eq!(slice_name("node-a", 0), "node-a-gpu.nvidia.com-0");
    let long = format!("{}.example", "n".repeat(245));
    let a = slice_name(&long, 1);
    assert!(a.len() <= MAX_SUBDOMAIN, "{}", a.len());
    assert!(a.ends_with("-gpu.nvidia.com-1"));
    let other = format!("{}.exampla", "n".repeat(245));
    assert_ne!(a, slice_name(&other, 1));
}

#[test]
fn a_full_gpu_carries_nvidias_attributes_and_its_memory() {
    let (devs, left) = devices(&node(vec![gpu(0)]));
    assert!(left.is_empty(), "{left:?}");
    let d = &devs[0];
    assert_eq!(d.name, "gpu-0");
    assert_eq!(attr(d, "type").string.as_deref(), Some("gpu"));
    assert_eq!(
        attr(d, "uuid").string.as_deref(),
        Some("GPU-00000000-0000-0000-0000-000000000000")
    );
    assert_eq!(
        attr(d, "driverVersion").version.as_deref(),
        Some("580.95.5")
    );
    assert_eq!(
        attr(d, "cudaDriverVersion").version.as_deref(),
        Some("13.0.0")
    );
    assert_eq!(
        attr(d, "cudaComputeCapability").version.as_deref(),
        Some("9.0.0")
    );
    assert_eq!(
        attr(d, "resource.kubernetes.io/pciBusID").string.as_deref(),
        Some("0000:18:00.0")
    );
    assert_eq!(
        attr(d, "resource.kubernetes.io/pcieRoot").string.as_deref(),
        Some("pci0000:00")
    );
    assert_eq!(attr(d, "numaNode").int, Some(1));
    assert_eq!(d.capacity.as_ref().unwrap()["memory"].value.0, "81559Mi");
    assert!(d.taints.is_none());
    assert!(!d.attributes.as_ref().unwrap().contains_key("parentUUID"));
}

#[test]
fn a_mig_enabled_gpu_is_published_only_as_its_mig_devices() {
    let mut g = gpu(1);
    g.mig_enabled = true;
    g.mig_devices = vec![mig(2, "1g.10gb+me", 20, 6), mig(1, "1g.10gb", 19, 0)];
    let (devs, left) = devices(&node(vec![gpu(0), g.clone()]));
    assert!(left.is_empty(), "{left:?}");
    assert_eq!(
        names_of(&devs),
        ["gpu-0", "gpu-1-mig-1g10gb-19-0", "gpu-1-mig-1g10gb-me-20-6"]
    );
    let m = &devs[1];
    assert_eq!(attr(m, "type").string.as_deref(), Some("mig"));
    assert_eq!(
        attr(m, "parentUUID").string.as_deref(),
        Some(g.uuid.as_str())
    );
    assert_eq!(attr(m, "profile").string.as_deref(), Some("1g.10gb"));
    assert_eq!(
        attr(m, "productName").string.as_deref(),
        Some("NVIDIA H100 80GB HBM3")
    );
    let c = m.capacity.as_ref().unwrap();
    assert_eq!(c["multiprocessors"].value.0, "16");
    assert_eq!(c["memory"].value.0, "9856Mi");
    assert_eq!(c.len(), 7);

    // MIG enabled and no MIG device: nothing of the GPU.
    g.mig_devices.clear();
    assert_eq!(
        names_of(&devices(&node(vec![g.clone()])).0),
        Vec::<&str>::new()
    );

    // A MIG device whose name cannot be made is left out, said why; its
    // GPU still is not published whole.
    g.mig_devices = vec![MigFacts {
        gi_profile_id: None,
        ..mig(3, "1g.10gb", 19, 0)
    }];
    let (devs, left) = devices(&node(vec![g]));
    assert!(devs.is_empty());
    assert_eq!(left.len(), 1);
    assert!(left[0].why.contains("GPU-instance profile ID"), "{left:?}");
}

#[test]
fn unhealthy_gpus_and_their_mig_devices_are_tainted() {
    let mut a = gpu(0);
    a.health = DeviceHealth::Xid(79);
    let mut b = gpu(1);
    b.health = DeviceHealth::Lost;
    b.mig_enabled = true;
    b.mig_devices = vec![mig(1, "1g.10gb", 19, 0)];
    let mut c = gpu(2);
    c.health = DeviceHealth::Unhealthy;
    let (devs, _) = devices(&node(vec![a, b, c, gpu(3)]));
    let t = |i: usize| devs[i].taints.clone().unwrap_or_default();
    assert_eq!(t(0)[0].key, XID_TAINT);
    assert_eq!(t(0)[0].value.as_deref(), Some("79"));
    assert_eq!(t(0)[0].effect, "NoSchedule");
    assert_eq!(t(1)[0].key, LOST_TAINT);
    assert_eq!(t(1)[0].value, None);
    assert_eq!(t(2)[0].key, UNHEALTHY_TAINT);
    assert!(t(3).is_empty());
}

#[test]
fn health_read_from_the_reports_fields() {
    let with = |healthy: bool, xid: Option<u64>, lost: bool, reason: &str| {
        DeviceHealth::from_report(&pb::GpuHealth {
            uuid: "GPU-a".into(),
            healthy,
            reason: reason.into(),
            advice: String::new(),
            xid,
            lost,
        })
    };
    let h = |healthy: bool, xid: Option<u64>, reason: &str| with(healthy, xid, false, reason);
    assert_eq!(h(true, None, ""), DeviceHealth::Healthy);
    assert_eq!(
        h(false, Some(79), "XID 79, from NVML"),
        DeviceHealth::Xid(79)
    );
    assert_eq!(
        h(false, Some(48), "XID 48, from the kernel log: DBE"),
        DeviceHealth::Xid(48)
    );
    // The field, not the words: an XID the words do not name is still one,
    // and words without the field (an agent from before it) are not.
    assert_eq!(
        h(false, Some(94), "contained ECC error"),
        DeviceHealth::Xid(94)
    );
    assert_eq!(h(false, None, "XID 79, from NVML"), DeviceHealth::Unhealthy);
    // A healthy GPU is healthy whatever else is set.
    assert_eq!(
        h(true, Some(79), "XID 79, from NVML"),
        DeviceHealth::Healthy
    );
    let lost_words = "NVML has lost the GPU (fallen off the bus): drain and reboot the node";
    assert_eq!(with(false, None, true, lost_words), DeviceHealth::Lost);
    // The field, not the words, here too.
    assert_eq!(with(false, None, true, "GPU lost"), DeviceHealth::Lost);
    assert_eq!(
        with(false, None, false, lost_words),
        DeviceHealth::Unhealthy
    );
    assert_eq!(with(true, None, true, lost_words), DeviceHealth::Healthy);
    assert_eq!(
        h(false, None, "double-bit ECC error"),
        DeviceHealth::Unhealthy
    );
}

/// `n` full GPUs, the ones in
/// `tainted` unhealthy.
fn many(n: u32, tainted: &[u32]) -> NodeDevices {
    let gpus = (0..n)
        .map(|i| {
            let mut g = gpu(i);
            if tainted.contains(&i) {
                g.health = DeviceHealth::Xid(43);
            }
            g
        })
        .collect();
    node(gpus)
}

fn sizes(s: &[ResourceSlice]) -> Vec<usize> {
    s.iter()
        .map(|s| s.spec.devices.as_ref().unwrap().len())
        .collect()
}

#[test]
fn slices_hold_128_devices_and_64_once_one_is_tainted() {
    let s = slices("node-a", "uid-a", &many(300, &[]), 4);
    assert_eq!(sizes(&s), [128, 128, 44]);
    let s = slices("node-a", "uid-a", &many(300, &[5]), 4);
    assert_eq!(sizes(&s), [64, 128, 108]);
    let s = slices("node-a", "uid-a", &many(130, &[100]), 4);
    assert_eq!(sizes(&s), [100, 30]);
    let s = slices("node-a", "uid-a", &many(130, &[0, 64, 127]), 4);
    assert_eq!(sizes(&s), [64, 64, 2]);
    for sl in &s {
        let tainted = sl
            .spec
            .devices
            .as_ref()
            .unwrap()
            .iter()
            .any(|d| d.taints.is_some());
        let n = sl.spec.devices.as_ref().unwrap().len();
        assert!(n <= if tainted { 64 } else { 128 });
        assert_eq!(sl.spec.pool.generation, 4);
        assert_eq!(sl.spec.pool.resource_slice_count, 3);
        assert_eq!(sl.spec.pool.name, "node-a");
        assert_eq!(sl.spec.node_name.as_deref(), Some("node-a"));
        assert_eq!(sl.spec.driver, "gpu.nvidia.com");
        let o = &sl.metadata.owner_references.as_ref().unwrap()[0];
        assert_eq!(
            (o.kind.as_str(), o.name.as_str(), o.uid.as_str()),
            ("Node", "node-a", "uid-a")
        );
        assert_eq!(o.controller, Some(true));
    }
    let names: Vec<_> = s.iter().map(|s| s.metadata.name.clone().unwrap()).collect();
    assert_eq!(
        names,
        [
            "node-a-gpu.nvidia.com-0",
            "node-a-gpu.nvidia.com-1",
            "node-a-gpu.nvidia.com-2"
        ]
    );
    // No device: one empty slice says the pool is empty.
    let s = slices("node-a", "uid-a", &node(vec![]), 1);
    assert_eq!(sizes(&s), [0]);
    assert_eq!(s[0].spec.pool.resource_slice_count, 1);
}

#[test]
fn the_same_node_gives_the_same_objects_and_nothing_to_write() {
    let mut g = gpu(1);
    g.mig_enabled = true;
    g.mig_devices = vec![mig(2, "2g.20gb", 14, 4), mig(1, "1g.10gb", 19, 0)];
    let n = node(vec![gpu(2), g, gpu(0)]);
    let a = slices("node-a", "uid-a", &n, 3);
    let b = slices("node-a", "uid-a", &n.clone(), 3);
    assert_eq!(a, b);
    assert_eq!(
        serde_json::to_string(&a).unwrap(),
        serde_json::to_string(&b).unwrap()
    );
    // GPUs in another order in the input: the same objects.
    let mut shuffled = n.clone();
    shuffled.gpus.reverse();
    assert_eq!(slices("node-a", "uid-a", &shuffled, 3), a);

    // As the API gives them back: a later generation does not matter, nor
    // the time the server stamps on a taint.
    let mut sick = n.clone();
    sick.gpus[0].health = DeviceHealth::Xid(79);
    let wanted = slices("node-a", "uid-a", &sick, 1);
    let mut read = slices("node-a", "uid-a", &sick, 7);
    for d in read[0].spec.devices.iter_mut().flatten() {
        for t in d.taints.iter_mut().flatten() {
            t.time_added = Some(Time("2026-11-27T03:00:00Z".parse().unwrap()));
        }
    }
    assert!(unchanged(&read, &wanted));
    assert_eq!(next_generation(&read), 8);
    assert_eq!(next_generation(&[]), 1);
    // The GPU recovered: a write.
    assert!(!unchanged(&read, &slices("node-a", "uid-a", &n, 1)));
    // Slices of two generations (a write cut short): a write.
    read[0].spec.pool.generation = 6;
    let mut two = read.clone();
    two.push(read[0].clone());
    two[1].spec.pool.generation = 7;
    assert!(!unchanged(&two, &wanted));
}

#[test]
fn a_report_without_the_minor_names_no_device() {
    let report = pb::NodeReport {
        inventory: Some(pb::Inventory {
            driver_version: "580.95.05".into(),
            cuda_version: "13.0".into(),
            gpus: vec![pb::Gpu {
                index: 0,
                uuid: "GPU-a".into(),
                model: "NVIDIA H100 80GB HBM3".into(),
                pci_bus_id: "00000000:18:00.0".into(),
                memory_mib: 81559,
                ..Default::default()
            }],
            simulated: String::new(),
        }),
        health: Some(pb::Health {
            gpus: vec![pb::GpuHealth {
                uuid: "GPU-a".into(),
                healthy: false,
                reason: "XID 79, from NVML".into(),
                xid: Some(79),
                ..Default::default()
            }],
        }),
        ..Default::default()
    };
    let facts = NodeDevices::from_report(&report);
    assert_eq!(facts.driver_version.as_deref(), Some("580.95.05"));
    assert_eq!(facts.cuda_driver_version.as_deref(), Some("13.0"));
    let g = &facts.gpus[0];
    assert_eq!(g.minor, None);
    assert_eq!(g.memory_bytes, Some(81559 << 20));
    assert_eq!(g.health, DeviceHealth::Xid(79));
    let (devs, left) = devices(&facts);
    assert!(devs.is_empty());
    assert!(left[0].why.contains("device minor"), "{left:?}");
    let s = resource_slices("node-a", "uid-a", &report, 1);
    assert_eq!(sizes(&s), [0]);
}

/// A report with every field the agent can fill: one full GPU, one with
/// MIG enabled and two MIG devices (one without its placement), the first
/// GPU unhealthy by an XID.
fn full_report() -> pb::NodeReport {
    let gpu = |minor: u32, uuid: &str, mig: Vec<pb::MigDevice>| pb::Gpu {
        index: minor,
        uuid: uuid.into(),
        model: "NVIDIA H100 80GB HBM3".into(),
        pci_bus_id: format!("00000000:{:02X}:00.0", 0x18 + minor),
        memory_mib: 81559,
        mig_enabled: !mig.is_empty(),
        mig_devices: mig,
        minor: Some(minor),
        brand: Some("Nvidia".into()),
        architecture: Some("Hopper".into()),
        compute_capability: Some("9.0".into()),
        pcie_root: Some("pci0000:15".into()),
        numa_node: Some(1),
    };
    let engines = pb::MigEngines {
        copy: 1,
        decoder: 1,
        encoder: 0,
        jpeg: 1,
        ofa: 1,
    };
    let migs = vec![
        pb::MigDevice {
            uuid: "MIG-b1".into(),
            profile: "1g.10gb+me".into(),
            gi_profile_id: Some(20),
            placement_start: Some(6),
            memory_mib: Some(9856),
            multiprocessors: Some(16),
            engines: Some(engines),
        },
        pb::MigDevice {
            uuid: "MIG-b2".into(),
            profile: "3g.40gb".into(),
            gi_profile_id: Some(9),
            memory_mib: Some(40192),
            ..Default::default()
        },
    ];
    pb::NodeReport {
        inventory: Some(pb::Inventory {
            driver_version: "580.95.05".into(),
            cuda_version: "13.0".into(),
            gpus: vec![gpu(3, "GPU-a", vec![]), gpu(5, "GPU-b", migs)],
            simulated: String::new(),
        }),
        health: Some(pb::Health {
            gpus: vec![
                pb::GpuHealth {
                    uuid: "GPU-a".into(),
                    healthy: false,
                    reason: "XID 79, from NVML".into(),
                    xid: Some(79),
                    ..Default::default()
                },
                pb::GpuHealth {
                    uuid: "GPU-b".into(),
                    healthy: true,
                    ..Default::default()
                },
            ],
        }),
        ..Default::default()
    }
}

#[test]
fn what_the_report_carries_names_and_describes_the_devices() {
    let report = full_report();
    let facts = NodeDevices::from_report(&report);
    let a = &facts.gpus[0];
    assert_eq!(a.minor, Some(3));
    assert_eq!(a.brand.as_deref(), Some("Nvidia"));
    assert_eq!(a.architecture.as_deref(), Some("Hopper"));
    assert_eq!(a.compute_capability.as_deref(), Some("9.0"));
    assert_eq!(a.pcie_root.as_deref(), Some("pci0000:15"));
    assert_eq!(a.numa_node, Some(1));
    assert_eq!(a.health, DeviceHealth::Xid(79));
    let m = &facts.gpus[1].mig_devices[0];
    assert_eq!(
        *m,
        MigFacts {
            uuid: "MIG-b1".into(),
            profile: "1g.10gb+me".into(),
            gi_profile_id: Some(20),
            placement_start: Some(6),
            memory_bytes: Some(9856 << 20),
            multiprocessors: Some(16),
            copy_engines: Some(1),
            decoders: Some(1),
            encoders: Some(0),
            jpeg_engines: Some(1),
            ofa_engines: Some(1),
        }
    );
    // Unset in the report, unset here: no engine counts are made up.
    let m2 = &facts.gpus[1].mig_devices[1];
    assert_eq!((m2.placement_start, m2.multiprocessors), (None, None));
    assert_eq!(m2.copy_engines, None);

    let (devs, left) = devices(&facts);
    let names: Vec<&str> = devs.iter().map(|d| d.name.as_str()).collect();
    // The MIG-enabled GPU only as its MIG devices; the MIG device without
    // its placement cannot be named and is said.
    assert_eq!(names, ["gpu-3", "gpu-5-mig-1g10gb-me-20-6"]);
    assert_eq!(left.len(), 1, "{left:?}");
    assert!(left[0].device.contains("MIG-b2"), "{left:?}");
    let g = devs[0].attributes.as_ref().unwrap();
    assert_eq!(g["type"].string.as_deref(), Some("gpu"));
    assert_eq!(g["brand"].string.as_deref(), Some("Nvidia"));
    assert_eq!(g["architecture"].string.as_deref(), Some("Hopper"));
    assert_eq!(g["cudaComputeCapability"].version.as_deref(), Some("9.0.0"));
    assert_eq!(
        g["resource.kubernetes.io/pcieRoot"].string.as_deref(),
        Some("pci0000:15")
    );
    let t = devs[0].taints.as_ref().unwrap();
    assert_eq!(
        (t[0].key.as_str(), t[0].value.as_deref()),
        (XID_TAINT, Some("79"))
    );
    let mig = &devs[1];
    let ma = mig.attributes.as_ref().unwrap();
    assert_eq!(ma["type"].string.as_deref(), Some("mig"));
    assert_eq!(ma["parentUUID"].string.as_deref(), Some("GPU-b"));
    assert_eq!(ma["profile"].string.as_deref(), Some("1g.10gb+me"));
    let c = mig.capacity.as_ref().unwrap();
    assert_eq!(c["memory"].value.0, "9856Mi");
    assert_eq!(c["multiprocessors"].value.0, "16");
    assert_eq!(c["ofaEngines"].value.0, "1");
    assert_eq!(c["encoders"].value.0, "0");
    assert!(mig.taints.is_none());
    let s = resource_slices("node-a", "uid-a", &report, 1);
    assert_eq!(sizes(&s), [2]);
}

#[test]
fn attributes_the_api_would_refuse_are_left_out_and_said() {
    let mut g = gpu(0);
    g.product_name = Some("x".repeat(65));
    g.compute_capability = Some("nine".into());
    g.pci_bus_id = Some("somewhere".into());
    let (devs, left) = devices(&node(vec![g]));
    let a = devs[0].attributes.as_ref().unwrap();
    assert!(!a.contains_key("productName"));
    assert!(!a.contains_key("cudaComputeCapability"));
    assert!(!a.contains_key("resource.kubernetes.io/pciBusID"));
    assert_eq!(left.len(), 3, "{left:?}");
    // Every device stays within the API's limits.
    let d = &devs[0];
    let n = a.len() + d.capacity.as_ref().map_or(0, |c| c.len());
    assert!(n <= slices::MAX_ATTRIBUTES_AND_CAPACITIES);
}

#[test]
fn device_classes_and_rbac_rules() {
    let c = device_classes();
    assert_eq!(c[0].metadata.name.as_deref(), Some("gpu.nvidia.com"));
    assert_eq!(
        c[0].spec.extended_resource_name.as_deref(),
        Some("nvidia.com/gpu")
    );
    let expr = &c[0].spec.selectors.as_ref().unwrap()[0]
        .cel
        .as_ref()
        .unwrap()
        .expression;
    assert_eq!(
        expr,
        "device.driver == 'gpu.nvidia.com' && device.attributes['gpu.nvidia.com'].type == 'gpu'"
    );
    assert_eq!(c[1].metadata.name.as_deref(), Some("mig.nvidia.com"));
    assert_eq!(c[1].spec.extended_resource_name, None);
    let r = rbac_rules();
    let verbs = |res: &str| {
        r.iter()
            .find(|r| r.resources.as_ref().unwrap()[0] == res)
            .unwrap()
            .verbs
            .join(",")
    };
    assert_eq!(verbs("resourceslices"), "create,update,delete,list,watch");
    assert_eq!(verbs("resourceclaims"), "list,watch");
    assert_eq!(verbs("deviceclasses"), "get,create,update");
}
