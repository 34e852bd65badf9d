//! The Container Device Interface as gpu-agent speaks it: the spec format
//! (the subset gpu-agent writes, and the workload check reads), the kind of
//! its devices, and the MIG access nodes a MIG device needs. Writing specs
//! is gpu-agent's `cdi`.

use serde::{Deserialize, Serialize};

/// The CDI kind gpu-agent's specs use (as `nvidia-ctk cdi generate`'s default):
/// devices `nvidia.com/gpu=<index>` and `nvidia.com/gpu=<UUID>`.
pub const CDI_KIND: &str = "nvidia.com/gpu";
/// The file gpu-agent writes the node's spec to, in the CDI spec directory:
/// the CDI front end writes it, the DRA front end takes its devices' edits.
pub const SPEC_FILE: &str = "gpu-agent-nvidia.com-gpu.json";
/// The CDI specification version our specs declare: the lowest that has
/// everything they use (device names starting with a digit came in 0.5.0).
pub const SPEC_VERSION: &str = "0.5.0";

/// A CDI spec (the subset of the specification gpu-agent writes).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct Spec {
    pub cdi_version: String,
    pub kind: String,
    pub devices: Vec<Device>,
    pub container_edits: ContainerEdits,
}

#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct Device {
    pub name: String,
    pub container_edits: ContainerEdits,
}

#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct ContainerEdits {
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub env: Vec<String>,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub device_nodes: Vec<DeviceNode>,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub mounts: Vec<Mount>,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub hooks: Vec<Hook>,
}

/// A device node; the runtime reads its type and numbers from the host's
/// node at container creation, so they are never stale.
#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct DeviceNode {
    pub path: String,
    /// The node on the host, where it is not `path` (CDI's `hostPath`).
    /// gpu-agent's own specs never need it; a spec that has it is kept
    /// whole (a claim's spec copies the node spec's edits).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub host_path: Option<String>,
}

#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct Mount {
    pub host_path: String,
    pub container_path: String,
    pub options: Vec<String>,
}

#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct Hook {
    pub hook_name: String,
    pub path: String,
    pub args: Vec<String>,
}

/// The `/dev/nvidia-caps` minors of a MIG device's GPU-instance and
/// compute-instance access capabilities (`gpu<minor>/gi<g>/access`,
/// `gpu<minor>/gi<g>/ci<c>/access` in `mig-minors`).
pub fn mig_access_minors(
    minors: &std::collections::BTreeMap<String, u32>,
    gpu_minor: u32,
    m: &crate::backend::MigDevice,
) -> Result<[u32; 2], String> {
    let (Some(gi), Some(ci)) = (m.gpu_instance_id, m.compute_instance_id) else {
        return Err("NVML did not give its GPU/compute instance IDs".into());
    };
    let gi_key = format!("gpu{gpu_minor}/gi{gi}/access");
    let ci_key = format!("gpu{gpu_minor}/gi{gi}/ci{ci}/access");
    match (minors.get(&gi_key), minors.get(&ci_key)) {
        (Some(a), Some(b)) => Ok([*a, *b]),
        _ => Err(format!(
            "{gi_key} or {ci_key} is not in /proc/driver/nvidia-caps/mig-minors"
        )),
    }
}
