//! Every DRA object the controller builds (issue 31) against the real
//! Kubernetes 1.36 schemas in `../shared/k8s-openapi-v1.36`, unknown fields
//! as errors: the ResourceSlices of the repository's simulated nodes
//! (`simnode/nodes/*.yaml`) turned into agent reports as the agent does,
//! the DeviceClasses, and the RBAC rules in a ClusterRole. On top of the
//! schema's types, the limits its descriptions state: device names DNS
//! labels, at most 32 attributes and capacities, 16 taints, string
//! attributes of 64 characters, versions semver 2.0.0, 128 devices a slice
//! (64 with taints), the pool's generation and slice count the same on
//! every slice.

mod common;

use std::collections::{BTreeMap, BTreeSet};
use std::path::PathBuf;

use common::schema;
use gpu_agent_proto::report::v1 as pb;
use gpu_controller::model::dra::{
    self, DeviceHealth, GpuFacts, MigFacts, NodeDevices, device_classes, rbac_rules,
};
use k8s_openapi::api::resource::v1::ResourceSlice;
use serde_json::{Value, json};

fn nodes_dir() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../simnode/nodes")
}

/// Every simulated node description, by name.
fn descriptions() -> BTreeMap<String, Value> {
    let mut out = BTreeMap::new();
    for e in std::fs::read_dir(nodes_dir()).unwrap() {
        let p = e.unwrap().path();
        if p.extension().is_some_and(|x| x == "yaml") {
            let text = std::fs::read_to_string(&p).unwrap();
            let v: Value = serde_yaml_ng::from_str(&text).unwrap();
            out.insert(p.file_stem().unwrap().to_string_lossy().into_owned(), v);
        }
    }
    assert!(
        out.len() >= 5,
        "simulated nodes in {}",
        nodes_dir().display()
    );
    out
}

/// NVML's spelling of a PCI address (`00000000:18:00.0`), as the agent
/// reports it.
fn nvml_bus_id(bus: &str) -> String {
    let (domain, rest) = bus.split_once(':').unwrap();
    format!(
        "{:08X}:{}",
        u32::from_str_radix(domain, 16).unwrap(),
        rest.to_ascii_uppercase()
    )
}

/// The GPU-instance profile IDs `nvidia-smi mig -lgip` lists for an H100
/// (simnode's table, the only MIG GPU among the simulated nodes).
fn h100_gi_profile_id(profile: &str) -> Option<u32> {
    Some(match profile {
        "1g.10gb" => 19,
        "1g.10gb+me" => 20,
        "1g.20gb" => 15,
        "2g.20gb" => 14,
        "3g.40gb" => 9,
        "4g.40gb" => 5,
        "7g.80gb" => 0,
        _ => return None,
    })
}

/// An H100's engines for a GPU instance of `slices` memory slices, as the
/// simulated backend reports them (simnode's `MigEngines::h100`).
fn h100_engines(slices: u32) -> pb::MigEngines {
    pb::MigEngines {
        copy: slices,
        decoder: slices,
        encoder: 0,
        jpeg: slices,
        ofa: u32::from(slices == 7),
    }
}

/// The report the agent sends for a simulated node, as
/// agent/src/supervisor/report.rs builds it from the simulated backend's
/// inventory (its test `the_report_carries_what_dra_names_and_describes_devices_by`
/// pins the same fields; the controller's tests cannot call the agent),
/// every GPU healthy: device minors as the simulated hosts number them
/// (NVML's index, tests/fixtures/hosts/*/proc/driver/nvidia/gpus), compute
/// capability and NUMA node from the description, MIG devices with their
/// GPU-instance profile ID, a placement (here the slices in the order
/// listed), memory, multiprocessors and engines. Brand, architecture and
/// PCIe root are left unset here and given by [`full_facts`] (the
/// descriptions do not hold them; the agent fills them from NVML and sysfs).
fn report_of(desc: &Value) -> pb::NodeReport {
    let gpus = desc["gpus"].as_array().cloned().unwrap_or_default();
    pb::NodeReport {
        inventory: Some(pb::Inventory {
            driver_version: desc["driver"]["version"].as_str().unwrap_or("").into(),
            cuda_version: desc["driver"]["cudaVersion"].as_str().unwrap_or("").into(),
            gpus: gpus
                .iter()
                .enumerate()
                .map(|(i, g)| {
                    let mig_on = g["mig"]["enabled"].as_bool().unwrap_or(false);
                    let mut start = 0;
                    pb::Gpu {
                        index: i as u32,
                        uuid: g["uuid"].as_str().unwrap().into(),
                        model: g["name"].as_str().unwrap().into(),
                        pci_bus_id: nvml_bus_id(g["busId"].as_str().unwrap()),
                        memory_mib: g["memoryMib"].as_u64().unwrap(),
                        mig_enabled: mig_on,
                        mig_devices: g["mig"]["devices"]
                            .as_array()
                            .into_iter()
                            .flatten()
                            .filter(|_| mig_on)
                            .map(|m| {
                                let slices = m["giSlices"].as_u64().unwrap() as u32;
                                let profile = m["profile"].as_str().unwrap();
                                start += slices;
                                pb::MigDevice {
                                    uuid: m["uuid"].as_str().unwrap().into(),
                                    profile: profile.into(),
                                    gi_profile_id: h100_gi_profile_id(profile),
                                    placement_start: Some(start - slices),
                                    memory_mib: m["memoryMib"].as_u64(),
                                    multiprocessors: m["multiprocessors"]
                                        .as_u64()
                                        .map(|v| v as u32),
                                    engines: Some(h100_engines(slices)),
                                }
                            })
                            .collect(),
                        minor: Some(i as u32),
                        compute_capability: g["computeCapability"].as_str().map(String::from),
                        numa_node: g["numaNode"].as_u64().map(|n| n as u32),
                        brand: None,
                        architecture: None,
                        pcie_root: None,
                    }
                })
                .collect(),
            simulated: desc["name"].as_str().unwrap_or("").into(),
        }),
        health: Some(pb::Health {
            gpus: gpus
                .iter()
                .map(|g| pb::GpuHealth {
                    uuid: g["uuid"].as_str().unwrap().into(),
                    healthy: true,
                    ..Default::default()
                })
                .collect(),
        }),
        ..Default::default()
    }
}

/// The node's devices from its report, with brand, architecture and PCIe
/// root as the agent reports them for an H100 node, so their attributes
/// are validated too.
fn full_facts(desc: &Value) -> NodeDevices {
    let mut facts = NodeDevices::from_report(&report_of(desc));
    for f in &mut facts.gpus {
        f.brand = Some("Nvidia".into());
        f.architecture = Some("Hopper".into());
        f.pcie_root = Some("pci0000:00".into());
    }
    facts
}

/// How many devices a node publishes: its GPUs without MIG, and every MIG
/// device.
fn expected_devices(facts: &NodeDevices) -> usize {
    facts
        .gpus
        .iter()
        .map(|g| {
            if g.mig_enabled {
                g.mig_devices.len()
            } else {
                1
            }
        })
        .sum()
}

/// Every slice's errors: the schema's and the limits its descriptions
/// state.
fn slice_errors(schemas: &BTreeMap<String, Value>, slices: &[ResourceSlice]) -> Vec<String> {
    let mut errs = Vec::new();
    let mut names = BTreeSet::new();
    let gens: BTreeSet<i64> = slices.iter().map(|s| s.spec.pool.generation).collect();
    if gens.len() != 1 {
        errs.push(format!("generations {gens:?}"));
    }
    for s in slices {
        let v = serde_json::to_value(s).unwrap();
        let at = s.metadata.name.clone().unwrap_or_default();
        for e in schema::check(schemas, "io.k8s.api.resource.v1.ResourceSlice", &v, false) {
            errs.push(format!("{at}: {e}"));
        }
        if v["apiVersion"] != "resource.k8s.io/v1" || v["kind"] != "ResourceSlice" {
            errs.push(format!(
                "{at}: apiVersion/kind {} {}",
                v["apiVersion"], v["kind"]
            ));
        }
        if at.len() > 253 {
            errs.push(format!("{at}: name over 253 characters"));
        }
        if s.spec.pool.resource_slice_count != slices.len() as i64 {
            errs.push(format!(
                "{at}: resourceSliceCount {}",
                s.spec.pool.resource_slice_count
            ));
        }
        let devs = s.spec.devices.as_deref().unwrap_or_default();
        let tainted = devs
            .iter()
            .any(|d| d.taints.as_ref().is_some_and(|t| !t.is_empty()));
        let limit = if tainted { 64 } else { 128 };
        if devs.len() > limit {
            errs.push(format!("{at}: {} devices (tainted: {tainted})", devs.len()));
        }
        for d in devs {
            let dn = &d.name;
            if !names.insert(dn.clone()) {
                errs.push(format!("{at}: device {dn} twice in the pool"));
            }
            if !dns_label(dn) {
                errs.push(format!("{at}: device {dn} is not a DNS label"));
            }
            let attrs = d.attributes.clone().unwrap_or_default();
            let n = attrs.len() + d.capacity.as_ref().map_or(0, |c| c.len());
            if n > 32 {
                errs.push(format!("{at}: {dn}: {n} attributes and capacities"));
            }
            let taints = d.taints.as_deref().unwrap_or_default();
            if taints.len() > 16 {
                errs.push(format!("{at}: {dn}: {} taints", taints.len()));
            }
            for t in taints {
                if !["None", "NoSchedule", "NoExecute"].contains(&t.effect.as_str()) {
                    errs.push(format!("{at}: {dn}: taint effect {}", t.effect));
                }
                if t.value.as_ref().is_some_and(|v| v.len() > 63) {
                    errs.push(format!("{at}: {dn}: taint value over 63"));
                }
            }
            for (k, a) in &attrs {
                let set = [
                    a.bool.is_some(),
                    a.int.is_some(),
                    a.string.is_some(),
                    a.version.is_some(),
                ]
                .iter()
                .filter(|x| **x)
                .count();
                if set != 1 {
                    errs.push(format!("{at}: {dn}: attribute {k} has {set} values"));
                }
                if a.string.as_ref().is_some_and(|s| s.chars().count() > 64) {
                    errs.push(format!("{at}: {dn}: attribute {k} over 64 characters"));
                }
                if let Some(v) = &a.version
                    && !semver(v)
                {
                    errs.push(format!("{at}: {dn}: attribute {k}: {v} is not semver"));
                }
            }
        }
    }
    errs
}

fn dns_label(s: &str) -> bool {
    !s.is_empty()
        && s.len() <= 63
        && s.bytes()
            .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == b'-')
        && !s.starts_with('-')
        && !s.ends_with('-')
}

/// semver 2.0.0's core (what we write: no pre-release or build): three
/// numbers without leading zeros.
fn semver(v: &str) -> bool {
    let parts: Vec<&str> = v.split('.').collect();
    v.len() <= 64
        && parts.len() == 3
        && parts.iter().all(|p| {
            !p.is_empty()
                && p.bytes().all(|c| c.is_ascii_digit())
                && (p.len() == 1 || !p.starts_with('0'))
        })
}

#[test]
fn the_schema_states_the_limits_we_split_by() {
    let schemas = schema::load();
    let d =
        schemas["io.k8s.api.resource.v1.ResourceSliceSpec"]["properties"]["devices"]["description"]
            .as_str()
            .unwrap();
    assert!(
        d.contains("Must not have more than 128 entries")
            && d.contains("If any device uses taints or consumes counters the limit is 64"),
        "{d}"
    );
    assert_eq!(dra::slices::MAX_DEVICES, 128);
    assert_eq!(dra::slices::MAX_DEVICES_WITH_TAINTS, 64);
}

#[test]
fn every_simulated_nodes_slices_validate() {
    let schemas = schema::load();
    let mut published = 0;
    for (name, desc) in descriptions() {
        let node = format!("node-{name}");
        // From the report as the agent makes it: every device, named.
        let report = report_of(&desc);
        let from_report = NodeDevices::from_report(&report);
        let (devs, left) = dra::devices(&from_report);
        assert!(left.is_empty(), "{name} (report): {left:?}");
        assert_eq!(
            devs.len(),
            expected_devices(&from_report),
            "{name} (report)"
        );
        let slices = dra::resource_slices(&node, "uid-1", &report, 1);
        let errs = slice_errors(&schemas, &slices);
        assert!(errs.is_empty(), "{name} (report):\n{}", errs.join("\n"));
        let in_slices: usize = slices
            .iter()
            .map(|s| s.spec.devices.as_ref().map_or(0, |d| d.len()))
            .sum();
        assert_eq!(in_slices, devs.len(), "{name} (report)");
        // With brand, architecture and PCIe root too.
        let facts = full_facts(&desc);
        let (devs, left) = dra::devices(&facts);
        assert!(left.is_empty(), "{name}: {left:?}");
        assert_eq!(devs.len(), expected_devices(&facts), "{name}");
        let slices = dra::slices(&node, "uid-1", &facts, 1);
        let errs = slice_errors(&schemas, &slices);
        assert!(errs.is_empty(), "{name}:\n{}", errs.join("\n"));
        published += devs.len();
    }
    assert!(published > 20, "{published} devices published");
}

#[test]
fn unhealthy_devices_and_a_big_node_validate() {
    let schemas = schema::load();
    let descs = descriptions();
    let mut facts = full_facts(&descs["h100-mig-2"]);
    facts.gpus[0].health = DeviceHealth::Xid(79);
    facts.gpus[1].health = DeviceHealth::Lost;
    let mut more = full_facts(&descs["h100-sxm-8"]).gpus;
    more[3].health = DeviceHealth::Unhealthy;
    facts.gpus.extend(more.into_iter().map(|mut g| {
        g.minor = g.minor.map(|m| m + 2);
        g
    }));
    let s = dra::slices("node-sick", "uid-2", &facts, 3);
    let errs = slice_errors(&schemas, &s);
    assert!(errs.is_empty(), "{}", errs.join("\n"));
    let taints: usize = s
        .iter()
        .flat_map(|s| s.spec.devices.iter().flatten())
        .filter(|d| d.taints.is_some())
        .count();
    assert_eq!(taints, 4 + 7 + 1);

    // 40 GPUs of 7 MIG devices each, one of them lost: 280 devices.
    let gpus: Vec<GpuFacts> = (0..40)
        .map(|i| {
            let mut g = full_facts(&descs["h100-sxm-8"]).gpus[0].clone();
            g.minor = Some(i);
            g.uuid = format!("GPU-{i:08x}-0000-0000-0000-000000000000");
            g.mig_enabled = true;
            g.mig_devices = (0..7)
                .map(|k| MigFacts {
                    uuid: format!("MIG-{i:04x}{k:04x}-0000-0000-0000-000000000000"),
                    profile: "1g.10gb+me".into(),
                    gi_profile_id: Some(20),
                    placement_start: Some(k),
                    memory_bytes: Some(9856 << 20),
                    multiprocessors: Some(16),
                    copy_engines: Some(1),
                    decoders: Some(1),
                    encoders: Some(0),
                    jpeg_engines: Some(1),
                    ofa_engines: Some(1),
                })
                .collect();
            if i == 30 {
                g.health = DeviceHealth::Lost;
            }
            g
        })
        .collect();
    let big = NodeDevices { gpus, ..facts };
    let s = dra::slices("node-big", "uid-3", &big, 9);
    let errs = slice_errors(&schemas, &s);
    assert!(errs.is_empty(), "{}", errs.join("\n"));
    let sizes: Vec<usize> = s
        .iter()
        .map(|s| s.spec.devices.as_ref().unwrap().len())
        .collect();
    assert_eq!(sizes.iter().sum::<usize>(), 280);
    assert!(sizes.len() >= 3, "{sizes:?}");
}

#[test]
fn device_classes_validate() {
    let schemas = schema::load();
    for c in device_classes() {
        let v = serde_json::to_value(&c).unwrap();
        assert_eq!(v["apiVersion"], "resource.k8s.io/v1");
        let errs = schema::check(&schemas, "io.k8s.api.resource.v1.DeviceClass", &v, false);
        assert!(errs.is_empty(), "{v}: {errs:?}");
    }
}

#[test]
fn rbac_rules_validate_and_name_served_resources() {
    let schemas = schema::load();
    let role = json!({
        "apiVersion": "rbac.authorization.k8s.io/v1",
        "kind": "ClusterRole",
        "metadata": {"name": "gpu-controller-dra"},
        "rules": serde_json::to_value(rbac_rules()).unwrap(),
    });
    let errs = schema::check(&schemas, "io.k8s.api.rbac.v1.ClusterRole", &role, false);
    assert!(errs.is_empty(), "{errs:?}");
    let doc: Value = serde_json::from_str(
        &std::fs::read_to_string(schema::dir().join("resource.k8s.io_v1.json")).unwrap(),
    )
    .unwrap();
    let paths = doc["paths"].as_object().unwrap();
    let verbs = [
        "get", "list", "watch", "create", "update", "patch", "delete",
    ];
    for r in rbac_rules() {
        assert_eq!(
            r.api_groups.as_deref(),
            Some(&["resource.k8s.io".to_string()][..])
        );
        for res in r.resources.iter().flatten() {
            assert!(
                paths.contains_key(&format!("/apis/resource.k8s.io/v1/{res}")),
                "{res} is not served by resource.k8s.io/v1"
            );
        }
        for v in &r.verbs {
            assert!(verbs.contains(&v.as_str()), "verb {v}");
        }
    }
}

/// The checks above are not blind: what the API server refuses fails them.
#[test]
fn the_checks_catch_what_the_api_refuses() {
    let schemas = schema::load();
    let facts = full_facts(&descriptions()["h100-mig-2"]);
    let good = dra::slices("node-a", "uid-1", &facts, 1);
    assert!(slice_errors(&schemas, &good).is_empty());

    let mut v = serde_json::to_value(&good[0]).unwrap();
    v["spec"]["devices"][0]["attributes"]["type"]["strng"] = json!("gpu");
    v["spec"]["pool"]["extra"] = json!(1);
    let errs = schema::check(&schemas, "io.k8s.api.resource.v1.ResourceSlice", &v, false);
    assert_eq!(errs.len(), 2, "{errs:?}");

    let mut bad = good.clone();
    let d = &mut bad[0].spec.devices.as_mut().unwrap()[0];
    d.name = "GPU_0".into();
    let a = d.attributes.as_mut().unwrap();
    a.get_mut("driverVersion").unwrap().version = Some("550.127.08".into());
    a.get_mut("productName").unwrap().string = Some("x".repeat(65));
    bad[0].spec.pool.resource_slice_count = 2;
    let errs = slice_errors(&schemas, &bad);
    assert_eq!(errs.len(), 4, "{errs:?}");
}

/// What a MIG device looks like, for the eye (`--nocapture`).
#[test]
fn show_a_mig_slice() {
    let facts = full_facts(&descriptions()["h100-mig-2"]);
    let s = dra::slices("node-a", "uid-1", &facts, 1);
    let mut v = serde_json::to_value(&s[0]).unwrap();
    v["spec"]["devices"].as_array_mut().unwrap().truncate(1);
    println!("{}", serde_json::to_string_pretty(&v).unwrap());
}

/// The ResourceClaims and templates docs/dra.md and the README show users:
/// each validates
/// against the 1.36 schema, names one of our DeviceClasses, and its CEL
/// selectors ask only for attributes and capacities our slices publish
/// (for an H100 node with MIG and one without).
#[test]
fn the_claims_in_the_docs_validate_and_ask_for_what_we_publish() {
    for doc in ["docs/dra.md", "README.md"] {
        claims_in(doc);
    }
}

fn claims_in(file: &str) {
    let schemas = schema::load();
    let doc = std::fs::read_to_string(
        PathBuf::from(env!("CARGO_MANIFEST_DIR"))
            .join("..")
            .join(file),
    )
    .unwrap();
    let blocks: Vec<Value> = doc
        .split("```yaml\n")
        .skip(1)
        .filter_map(|b| b.split("```").next())
        .filter_map(|y| serde_yaml_ng::from_str::<Value>(y).ok())
        .filter(|v| {
            v["apiVersion"] == "resource.k8s.io/v1"
                && matches!(
                    v["kind"].as_str(),
                    Some("ResourceClaim" | "ResourceClaimTemplate")
                )
        })
        .collect();
    assert_eq!(blocks.len(), 3, "the three claims of {file}");
    // What our slices carry, over every simulated node.
    let mut published = BTreeSet::new();
    for desc in descriptions().values() {
        let (devices, _) = dra::devices(&full_facts(desc));
        for d in devices {
            for k in d.attributes.unwrap_or_default().keys() {
                published.insert(format!("attributes.{k}"));
            }
            for k in d.capacity.unwrap_or_default().keys() {
                published.insert(format!("capacity.{k}"));
            }
        }
    }
    let classes: Vec<String> = device_classes()
        .into_iter()
        .map(|c| c.metadata.name.unwrap())
        .collect();
    for claim in &blocks {
        let kind = claim["kind"].as_str().unwrap();
        let errs = schema::check(
            &schemas,
            &format!("io.k8s.api.resource.v1.{kind}"),
            claim,
            false,
        );
        assert!(errs.is_empty(), "{claim}: {errs:?}");
        let spec = if kind == "ResourceClaimTemplate" {
            &claim["spec"]["spec"]
        } else {
            &claim["spec"]
        };
        for r in spec["devices"]["requests"].as_array().unwrap() {
            let class = r["exactly"]["deviceClassName"].as_str().unwrap();
            assert!(classes.iter().any(|c| c == class), "{class}");
            for s in r["exactly"]["selectors"].as_array().into_iter().flatten() {
                let cel = s["cel"]["expression"].as_str().unwrap();
                for (what, prefix) in [
                    ("attributes", "device.attributes['gpu.nvidia.com']."),
                    ("capacity", "device.capacity['gpu.nvidia.com']."),
                ] {
                    for part in cel.split(prefix).skip(1) {
                        let name: String = part
                            .chars()
                            .take_while(|c| c.is_ascii_alphanumeric())
                            .collect();
                        assert!(
                            published.contains(&format!("{what}.{name}")),
                            "{cel}: {what} {name} is not published (we publish {published:?})"
                        );
                    }
                }
            }
        }
        for c in spec["devices"]["config"].as_array().into_iter().flatten() {
            assert_eq!(c["opaque"]["driver"], "gpu.nvidia.com");
            assert_eq!(
                c["opaque"]["parameters"]["apiVersion"],
                "resource.nvidia.com/v1beta1"
            );
        }
    }
}
