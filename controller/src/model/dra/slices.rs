//! The node's DRA devices (NVIDIA's attribute names, capacities, health as
//! device taints) and the ResourceSlices of its pool they are split into;
//! whether the slices the API has already are these ([`unchanged`]).

use std::collections::BTreeMap;

use gpu_agent_proto::report::v1 as pb;
use k8s_openapi::api::resource::v1::{
    Device, DeviceAttribute, DeviceCapacity, DeviceTaint, ResourcePool, ResourceSlice,
    ResourceSliceSpec,
};
use k8s_openapi::apimachinery::pkg::api::resource::Quantity;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{ObjectMeta, OwnerReference};

use super::facts::{DeviceHealth, GpuFacts, MigFacts, NodeDevices};
use super::names;
use super::names::DRIVER;

/// Most devices in one slice.
pub const MAX_DEVICES: usize = 128;
/// Most devices in a slice where any device has taints.
pub const MAX_DEVICES_WITH_TAINTS: usize = 64;
/// Most attributes and capacities of one device, together.
pub const MAX_ATTRIBUTES_AND_CAPACITIES: usize = 32;
/// Most taints of one device.
pub const MAX_TAINTS: usize = 16;

/// An XID made the GPU unhealthy; the value is the XID.
pub const XID_TAINT: &str = "gpu.nvidia.com/xid";
/// NVML lost the GPU.
pub const LOST_TAINT: &str = "gpu.nvidia.com/gpu-lost";
/// Unhealthy for a reason that is neither (ECC, retired pages, no health
/// monitoring): our key, NVIDIA's driver has none for these.
pub const UNHEALTHY_TAINT: &str = "gpu.nvidia.com/unhealthy";
/// Every taint here keeps new claims off the device.
pub const TAINT_EFFECT: &str = "NoSchedule";

/// A device, or an attribute of one, that is not published, and why.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct LeftOut {
    /// The GPU's or MIG device's UUID (or where it is, when it has none).
    pub device: String,
    pub why: String,
}

/// Where a device goes in the pool: by GPU minor, the GPU before its MIG
/// devices, MIG devices by placement.
type Order = (u32, u32, u32, String);

/// The node's devices in a fixed order, and what was left out.
pub fn devices(node: &NodeDevices) -> (Vec<Device>, Vec<LeftOut>) {
    let mut out: Vec<(Order, Device)> = Vec::new();
    let mut left = Vec::new();
    for g in &node.gpus {
        if g.uuid.is_empty() {
            let at = g.pci_bus_id.as_deref().unwrap_or("an unknown PCI address");
            left.push(LeftOut {
                device: format!("the GPU at {at}"),
                why: "the report gives no UUID".into(),
            });
            continue;
        }
        let Some(minor) = g.minor else {
            left.push(LeftOut {
                device: g.uuid.clone(),
                why: "the report gives no device minor, which names the device (gpu-<minor>)"
                    .into(),
            });
            continue;
        };
        let taints = taints(&g.health);
        if !g.mig_enabled {
            let d = gpu_device(node, g, minor, &taints, &mut left);
            out.push(((minor, 0, 0, d.name.clone()), d));
            continue;
        }
        // A MIG-enabled GPU is published only as its MIG devices (#719).
        for m in &g.mig_devices {
            let (Some(gi), Some(start)) = (m.gi_profile_id, m.placement_start) else {
                left.push(LeftOut {
                    device: m.uuid.clone(),
                    why: "the report gives no GPU-instance profile ID and placement start, which name a MIG device".into(),
                });
                continue;
            };
            let name = names::mig_name(minor, &m.profile, gi, start);
            if !names::is_dns_label(&name) {
                left.push(LeftOut {
                    device: m.uuid.clone(),
                    why: format!("its name {name:?} is not a DNS label"),
                });
                continue;
            }
            let d = mig_device(node, g, m, name, &taints, &mut left);
            out.push(((minor, 1, start, d.name.clone()), d));
        }
    }
    out.sort_by(|a, b| a.0.cmp(&b.0));
    let mut seen = std::collections::BTreeSet::new();
    let mut devs = Vec::with_capacity(out.len());
    for (_, d) in out {
        if seen.insert(d.name.clone()) {
            devs.push(d);
        } else {
            left.push(LeftOut {
                device: d.name.clone(),
                why: "another device of the node has the same name".into(),
            });
        }
    }
    (devs, left)
}

/// The node's pool as ResourceSlices at `generation`: driver
/// `gpu.nvidia.com`, pool and `spec.nodeName` the node, owned by the Node,
/// at most [`MAX_DEVICES`] devices a slice ([`MAX_DEVICES_WITH_TAINTS`] in
/// one with a tainted device). A node without devices has one empty slice,
/// which says its pool is empty. The same input gives the same objects.
pub fn slices(
    node_name: &str,
    node_uid: &str,
    node: &NodeDevices,
    generation: i64,
) -> Vec<ResourceSlice> {
    let chunks = split(devices(node).0);
    let count = chunks.len() as i64;
    chunks
        .into_iter()
        .enumerate()
        .map(|(i, devices)| ResourceSlice {
            metadata: ObjectMeta {
                name: Some(names::slice_name(node_name, i)),
                owner_references: Some(vec![OwnerReference {
                    api_version: "v1".into(),
                    kind: "Node".into(),
                    name: node_name.to_string(),
                    uid: node_uid.to_string(),
                    controller: Some(true),
                    block_owner_deletion: None,
                }]),
                ..Default::default()
            },
            spec: ResourceSliceSpec {
                driver: DRIVER.into(),
                node_name: Some(node_name.to_string()),
                pool: ResourcePool {
                    name: node_name.to_string(),
                    generation,
                    resource_slice_count: count,
                },
                devices: Some(devices),
                ..Default::default()
            },
        })
        .collect()
}

/// [`slices`] of what the agent's report says of the node.
pub fn resource_slices(
    node_name: &str,
    node_uid: &str,
    report: &pb::NodeReport,
    generation: i64,
) -> Vec<ResourceSlice> {
    slices(
        node_name,
        node_uid,
        &NodeDevices::from_report(report),
        generation,
    )
}

/// The generation to write a changed pool at: one over the highest the
/// API has (1 for a new pool), so consumers drop every older slice.
pub fn next_generation(existing: &[ResourceSlice]) -> i64 {
    existing
        .iter()
        .map(|s| s.spec.pool.generation)
        .max()
        .map_or(1, |g| g + 1)
}

/// Whether the API's slices of the pool are `wanted` already, whatever
/// their generation: nothing to write then. Fields the API server fills
/// (status, metadata besides name and owners, a taint's `timeAdded`) do not
/// count.
pub fn unchanged(existing: &[ResourceSlice], wanted: &[ResourceSlice]) -> bool {
    fn key(
        s: &ResourceSlice,
    ) -> (
        Option<String>,
        Option<Vec<OwnerReference>>,
        ResourceSliceSpec,
    ) {
        let mut spec = s.spec.clone();
        spec.pool.generation = 0;
        for d in spec.devices.iter_mut().flatten() {
            for t in d.taints.iter_mut().flatten() {
                t.time_added = None;
            }
        }
        (
            s.metadata.name.clone(),
            s.metadata.owner_references.clone(),
            spec,
        )
    }
    if existing.len() != wanted.len() {
        return false;
    }
    let gens: std::collections::BTreeSet<i64> =
        existing.iter().map(|s| s.spec.pool.generation).collect();
    let mut a: Vec<_> = existing.iter().map(key).collect();
    let mut b: Vec<_> = wanted.iter().map(key).collect();
    a.sort_by(|x, y| x.0.cmp(&y.0));
    b.sort_by(|x, y| x.0.cmp(&y.0));
    gens.len() <= 1 && a == b
}

/// Devices into slices, in order: a slice takes devices until the next
/// would pass its limit (64 once any of its devices has taints, else 128).
fn split(devs: Vec<Device>) -> Vec<Vec<Device>> {
    let tainted = |d: &Device| d.taints.as_ref().is_some_and(|t| !t.is_empty());
    let mut out = Vec::new();
    let mut cur: Vec<Device> = Vec::new();
    let mut cur_tainted = false;
    for d in devs {
        let t = cur_tainted || tainted(&d);
        let limit = if t {
            MAX_DEVICES_WITH_TAINTS
        } else {
            MAX_DEVICES
        };
        if cur.len() < limit {
            cur_tainted = t;
            cur.push(d);
        } else {
            cur_tainted = tainted(&d);
            out.push(std::mem::replace(&mut cur, vec![d]));
        }
    }
    if !cur.is_empty() || out.is_empty() {
        out.push(cur);
    }
    out
}

fn taints(h: &DeviceHealth) -> Vec<DeviceTaint> {
    let taint = |key: &str, value: Option<String>| DeviceTaint {
        key: key.into(),
        value,
        effect: TAINT_EFFECT.into(),
        time_added: None,
    };
    match h {
        DeviceHealth::Healthy => vec![],
        DeviceHealth::Xid(x) => vec![taint(XID_TAINT, Some(x.to_string()))],
        DeviceHealth::Lost => vec![taint(LOST_TAINT, None)],
        DeviceHealth::Unhealthy => vec![taint(UNHEALTHY_TAINT, None)],
    }
}

/// A device's attributes, leaving out (and saying so) values the API
/// would refuse.
struct Attrs<'a> {
    map: BTreeMap<String, DeviceAttribute>,
    device: &'a str,
    left: &'a mut Vec<LeftOut>,
}

impl Attrs<'_> {
    fn skip(&mut self, key: &str, why: String) {
        self.left.push(LeftOut {
            device: self.device.to_string(),
            why: format!("attribute {key}: {why}"),
        });
    }

    fn string(&mut self, key: &str, v: Option<&str>) {
        let Some(v) = v else { return };
        if v.chars().count() > names::MAX_ATTRIBUTE {
            self.skip(
                key,
                format!("{v:?} is over {} characters", names::MAX_ATTRIBUTE),
            );
            return;
        }
        let a = DeviceAttribute {
            string: Some(v.to_string()),
            ..Default::default()
        };
        self.map.insert(key.into(), a);
    }

    fn version(&mut self, key: &str, v: Option<&str>) {
        let Some(v) = v else { return };
        match names::semver(v) {
            Some(s) => {
                let a = DeviceAttribute {
                    version: Some(s),
                    ..Default::default()
                };
                self.map.insert(key.into(), a);
            }
            None => self.skip(key, format!("{v:?} is not a version")),
        }
    }

    fn int(&mut self, key: &str, v: Option<i64>) {
        if let Some(v) = v {
            let a = DeviceAttribute {
                int: Some(v),
                ..Default::default()
            };
            self.map.insert(key.into(), a);
        }
    }

    /// What a GPU and its MIG devices share (the GPU's).
    fn gpu_common(&mut self, node: &NodeDevices, g: &GpuFacts) {
        self.string("productName", g.product_name.as_deref());
        self.string("brand", g.brand.as_deref());
        self.string("architecture", g.architecture.as_deref());
        self.version("cudaComputeCapability", g.compute_capability.as_deref());
        self.version("driverVersion", node.driver_version.as_deref());
        self.version("cudaDriverVersion", node.cuda_driver_version.as_deref());
        if let Some(raw) = g.pci_bus_id.as_deref() {
            match names::pci_bus_id(raw) {
                Some(id) => self.string("resource.kubernetes.io/pciBusID", Some(&id)),
                None => self.skip(
                    "resource.kubernetes.io/pciBusID",
                    format!("{raw:?} is not a PCI address"),
                ),
            }
        }
        self.string("resource.kubernetes.io/pcieRoot", g.pcie_root.as_deref());
        self.int("numaNode", g.numa_node);
    }
}

fn capacity(map: &mut BTreeMap<String, DeviceCapacity>, key: &str, q: Option<String>) {
    if let Some(q) = q {
        let c = DeviceCapacity {
            value: Quantity(q),
            request_policy: None,
        };
        map.insert(key.into(), c);
    }
}

fn device(
    name: String,
    attributes: BTreeMap<String, DeviceAttribute>,
    capacity: BTreeMap<String, DeviceCapacity>,
    taints: &[DeviceTaint],
) -> Device {
    Device {
        name,
        attributes: (!attributes.is_empty()).then_some(attributes),
        capacity: (!capacity.is_empty()).then_some(capacity),
        taints: (!taints.is_empty()).then(|| taints.to_vec()),
        ..Default::default()
    }
}

fn gpu_device(
    node: &NodeDevices,
    g: &GpuFacts,
    minor: u32,
    taints: &[DeviceTaint],
    left: &mut Vec<LeftOut>,
) -> Device {
    let mut a = Attrs {
        map: BTreeMap::new(),
        device: &g.uuid,
        left,
    };
    a.string("type", Some("gpu"));
    a.string("uuid", Some(&g.uuid));
    a.gpu_common(node, g);
    let mut c = BTreeMap::new();
    capacity(&mut c, "memory", g.memory_bytes.map(names::binary_si));
    device(names::gpu_name(minor), a.map, c, taints)
}

fn mig_device(
    node: &NodeDevices,
    g: &GpuFacts,
    m: &MigFacts,
    name: String,
    taints: &[DeviceTaint],
    left: &mut Vec<LeftOut>,
) -> Device {
    let mut a = Attrs {
        map: BTreeMap::new(),
        device: &m.uuid,
        left,
    };
    a.string("type", Some("mig"));
    a.string("uuid", Some(&m.uuid));
    a.string("parentUUID", Some(&g.uuid));
    a.string("profile", Some(&m.profile));
    a.gpu_common(node, g);
    let mut c = BTreeMap::new();
    let count = |n: Option<u32>| n.map(|n| names::decimal_si(n.into()));
    capacity(&mut c, "multiprocessors", count(m.multiprocessors));
    capacity(&mut c, "copyEngines", count(m.copy_engines));
    capacity(&mut c, "decoders", count(m.decoders));
    capacity(&mut c, "encoders", count(m.encoders));
    capacity(&mut c, "jpegEngines", count(m.jpeg_engines));
    capacity(&mut c, "ofaEngines", count(m.ofa_engines));
    capacity(&mut c, "memory", m.memory_bytes.map(names::binary_si));
    device(name, a.map, c, taints)
}
