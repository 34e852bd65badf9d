//! A claim's transient CDI spec (kind `k8s.gpu.nvidia.com/claim`, NVIDIA's
//! names): built from the node's own spec that gpu-agent's cdi stage writes,
//! its device nodes checked on the host, and where it lives.

use std::collections::BTreeMap;

use gpu_model::cdi::{CDI_KIND, Device, SPEC_VERSION, Spec};
use hostlib::HostRoot;

use super::devices::NodeDevice;
use super::error::{ClaimError, Named};

/// The kind of the claims' CDI devices: vendor `k8s.gpu.nvidia.com`, class
/// `claim`, as NVIDIA's driver names them.
pub const CLAIM_KIND: &str = "k8s.gpu.nvidia.com/claim";

/// The node spec's file name in its directory: the one the CDI front end
/// writes (`gpu_model::cdi::SPEC_FILE`).
pub use gpu_model::cdi::SPEC_FILE as NODE_SPEC_FILE;

/// Transient spec files: `k8s.gpu.nvidia.com-claim_<claimUID>.yaml` (CDI's
/// `GenerateTransientSpecName(vendor, class, uid)`).
const SPEC_PREFIX: &str = "k8s.gpu.nvidia.com-claim_";
const SPEC_SUFFIX: &str = ".yaml";

/// Control nodes a claim's container needs whatever its devices: a node
/// spec written before the driver made them names none, and a claim
/// prepared from it would start without CUDA (NVIDIA #1380).
pub const REQUIRED_CONTROL_NODES: &[&str] = &["/dev/nvidiactl", "/dev/nvidia-uvm"];

/// The file name of claim `uid`'s spec.
pub fn spec_file_name(uid: &str) -> String {
    format!("{SPEC_PREFIX}{uid}{SPEC_SUFFIX}")
}

/// The host path of claim `uid`'s spec in `cdi_dir`.
pub fn spec_path(cdi_dir: &str, uid: &str) -> String {
    format!("{}/{}", cdi_dir.trim_end_matches('/'), spec_file_name(uid))
}

/// The claim UID a transient spec file is named after, if it is one.
pub fn uid_of_spec_file(name: &str) -> Option<&str> {
    name.strip_prefix(SPEC_PREFIX)?
        .strip_suffix(SPEC_SUFFIX)
        .filter(|u| valid_uid(u))
}

/// A UID that can name files and CDI devices: letters, digits and `-`
/// (Kubernetes UIDs are RFC 4122 UUIDs).
pub fn valid_uid(uid: &str) -> bool {
    !uid.is_empty()
        && uid.len() <= 128
        && uid.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'-')
}

/// The CDI device name of `device` in claim `uid`'s spec.
pub fn claim_device_name(uid: &str, device: &str) -> String {
    format!("{uid}-{device}")
}

/// The fully qualified CDI ID the kubelet hands the runtime:
/// `k8s.gpu.nvidia.com/claim=<uid>-<device>`.
pub fn cdi_device_id(uid: &str, device: &str) -> String {
    format!("{CLAIM_KIND}={}", claim_device_name(uid, device))
}

/// Reads and checks the node's spec (kind `nvidia.com/gpu`), read anew for
/// every prepare so a replaced driver is never served from a cache
/// (NVIDIA #1144). `Err` says what is wrong, for [`ClaimError::NodeSpec`].
pub(crate) fn read_node_spec(host: &HostRoot, path: &str) -> Result<Spec, String> {
    let text = match host.read_optional(path) {
        Ok(Some(t)) => t,
        Ok(None) => return Err("missing (gpu-agent's cdi stage has not written it)".into()),
        Err(e) => return Err(e.to_string()),
    };
    let spec: Spec = serde_json::from_str(&text).map_err(|e| format!("not a CDI spec: {e}"))?;
    if spec.kind != CDI_KIND {
        return Err(format!("kind {}, not {CDI_KIND}", spec.kind));
    }
    Ok(spec)
}

/// Claim `claim`'s spec: one device `<uid>-<name>` per device in `devices`
/// with the node spec's edits of that device, and the node spec's common
/// edits at the top. Fails rather than build an empty or partial spec.
pub(crate) fn claim_spec(
    claim: &Named,
    node_spec: &Spec,
    node_spec_path: &str,
    devices: &BTreeMap<String, NodeDevice>,
) -> Result<Spec, ClaimError> {
    let spec_err = |why: String| ClaimError::NodeSpec {
        claim: claim.clone(),
        path: node_spec_path.to_string(),
        why,
    };
    let common = &node_spec.container_edits;
    let lacking: Vec<&str> = REQUIRED_CONTROL_NODES
        .iter()
        .copied()
        .filter(|n| !common.device_nodes.iter().any(|d| d.path == *n))
        .collect();
    if !lacking.is_empty() {
        return Err(spec_err(format!(
            "names no {} (written before the driver's control nodes existed?)",
            lacking.join(", ")
        )));
    }
    let mut out = Vec::new();
    for (name, dev) in devices {
        let Some(found) = node_spec.devices.iter().find(|d| d.name == dev.uuid) else {
            return Err(spec_err(format!(
                "has no device {} (for {name}); it is older than the GPU",
                dev.uuid
            )));
        };
        if found.container_edits.device_nodes.is_empty() {
            return Err(spec_err(format!(
                "device {} (for {name}) has no device nodes",
                dev.uuid
            )));
        }
        out.push(Device {
            name: claim_device_name(&claim.0.uid, name),
            container_edits: found.container_edits.clone(),
        });
    }
    if out.is_empty() {
        return Err(ClaimError::NoDevices {
            claim: claim.clone(),
        });
    }
    Ok(Spec {
        cdi_version: SPEC_VERSION.into(),
        kind: CLAIM_KIND.into(),
        devices: out,
        container_edits: common.clone(),
    })
}

/// The device nodes `spec` names that do not exist on the host (where a
/// node has a `hostPath`, that is the one the runtime opens).
pub(crate) fn missing_device_nodes(host: &HostRoot, spec: &Spec) -> Vec<String> {
    let mut missing: Vec<String> = Vec::new();
    let all = spec
        .devices
        .iter()
        .map(|d| &d.container_edits)
        .chain(std::iter::once(&spec.container_edits));
    for edits in all {
        for n in &edits.device_nodes {
            let on_host = n.host_path.as_deref().unwrap_or(&n.path);
            if !host.exists(on_host) && !missing.iter().any(|m| m == on_host) {
                missing.push(on_host.to_string());
            }
        }
    }
    missing
}

/// The spec as written: YAML.
pub(crate) fn to_yaml(spec: &Spec) -> String {
    serde_yaml_ng::to_string(spec).expect("a CDI spec always serialises")
}

/// Parses a transient spec written by [`to_yaml`]; checks its kind.
pub(crate) fn parse_claim_spec(text: &str) -> Result<Spec, String> {
    let spec: Spec = serde_yaml_ng::from_str(text).map_err(|e| e.to_string())?;
    if spec.kind != CLAIM_KIND {
        return Err(format!("kind {}, not {CLAIM_KIND}", spec.kind));
    }
    Ok(spec)
}

/// A claim's spec written with MPS edits (the pipe directory in a
/// device's environment) says the claim had a daemon; its settings are
/// not in the spec, so it is started again with none set.
pub(crate) fn mps_of_spec(spec: &Spec) -> Option<super::sharing::MpsSettings> {
    let env = format!(
        "CUDA_MPS_PIPE_DIRECTORY={}",
        super::sharing::CONTAINER_PIPE_DIR
    );
    spec.devices
        .iter()
        .any(|d| d.container_edits.env.contains(&env))
        .then(super::sharing::MpsSettings::default)
}

/// The device names (`gpu-0`) of a claim's spec, from its CDI device names.
pub(crate) fn spec_device_names(uid: &str, spec: &Spec) -> Vec<String> {
    let prefix = format!("{uid}-");
    spec.devices
        .iter()
        .filter_map(|d| d.name.strip_prefix(&prefix).map(str::to_string))
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_are_nvidias() {
        let uid = "dab5ab50-d59a-42a6-af16-cfd4628c0f7a";
        assert_eq!(
            cdi_device_id(uid, "gpu-0"),
            "k8s.gpu.nvidia.com/claim=dab5ab50-d59a-42a6-af16-cfd4628c0f7a-gpu-0"
        );
        assert_eq!(
            spec_path("/var/run/cdi/", uid),
            "/var/run/cdi/k8s.gpu.nvidia.com-claim_dab5ab50-d59a-42a6-af16-cfd4628c0f7a.yaml"
        );
        assert_eq!(uid_of_spec_file(&spec_file_name(uid)), Some(uid));
    }

    #[test]
    fn only_our_spec_files_with_plain_uids_are_claims() {
        for name in [
            "gpu-agent-nvidia.com-gpu.json",
            "k8s.gpu.nvidia.com-claim_.yaml",
            "k8s.gpu.nvidia.com-claim_a..b.yaml",
            "k8s.gpu.nvidia.com-claim_abc.json",
            ".k8s.gpu.nvidia.com-claim_abc.yaml.gpu-agent-tmp.1.0",
        ] {
            assert_eq!(uid_of_spec_file(name), None, "{name}");
        }
        assert!(!valid_uid("../etc"));
        assert!(!valid_uid("a/b"));
        assert!(valid_uid("0c7e1d7a-2f4b"));
    }

    #[test]
    fn missing_nodes_are_looked_for_where_the_runtime_opens_them() {
        let dir = tempfile::tempdir().unwrap();
        let host = HostRoot::new(dir.path()).unwrap();
        for n in ["dev/nvidia0", "dev/nvidiactl", "dev/stand-in"] {
            std::fs::create_dir_all(dir.path().join(n).parent().unwrap()).unwrap();
            std::fs::write(dir.path().join(n), "").unwrap();
        }
        let mut spec = crate::claims::tests_support::node_spec();
        spec.devices.truncate(3);
        // Each once, devices' first; /dev/nvidia1 twice in the spec.
        assert_eq!(
            missing_device_nodes(&host, &spec),
            ["/dev/nvidia1", "/dev/nvidia-uvm"]
        );
        // A hostPath is what must exist, not the path in the container.
        spec.container_edits.device_nodes[1].host_path = Some("/dev/stand-in".into());
        spec.devices[2].container_edits.device_nodes[0].host_path = Some("/dev/gone".into());
        assert_eq!(missing_device_nodes(&host, &spec), ["/dev/gone"]);
    }
}
