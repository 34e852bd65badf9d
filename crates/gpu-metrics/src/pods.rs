//! Which container holds which GPU, from the kubelet's pod-resources API
//! (`List` over `/var/lib/kubelet/pod-resources/kubelet.sock`).
//!
//! Device IDs are whatever the device plugin advertised: a GPU's UUID or
//! index, a time-sliced replica (`<UUID>::<n>`), a MIG device's UUID or
//! `<gpu>:<slot>`. Every resource under `nvidia.com/` counts, renamed shared
//! ones (`nvidia.com/gpu.shared`) and MIG ones (`nvidia.com/mig-1g.10gb`)
//! included — the cases where dcgm-exporter loses pod labels.

use std::collections::BTreeMap;
use std::path::Path;
use std::time::Duration;

use gpu_agent_proto::podresources::v1::{
    ListPodResourcesRequest, ListPodResourcesResponse,
    pod_resources_lister_client::PodResourcesListerClient,
};

use gpu_model::inventory::Inventory;

/// The socket's host path.
pub const POD_RESOURCES_SOCKET: &str = "/var/lib/kubelet/pod-resources/kubelet.sock";
/// How long one `List` may take.
const LIST_TIMEOUT: Duration = Duration::from_secs(2);

/// A container using a device.
#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub struct PodRef {
    pub pod: String,
    pub namespace: String,
    pub container: String,
}

/// Containers by the UUID of the GPU or MIG device they hold.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct PodMap {
    pub by_uuid: BTreeMap<String, Vec<PodRef>>,
}

impl PodMap {
    pub fn of(&self, uuid: &str) -> &[PodRef] {
        self.by_uuid.get(uuid).map_or(&[], Vec::as_slice)
    }

    /// Builds the map from a `List` answer, resolving IDs against `inv`.
    pub fn from_list(list: &ListPodResourcesResponse, inv: &Inventory) -> PodMap {
        let mut by_uuid: BTreeMap<String, Vec<PodRef>> = BTreeMap::new();
        for pod in &list.pod_resources {
            for c in &pod.containers {
                for d in &c.devices {
                    if !d.resource_name.starts_with("nvidia.com/") {
                        continue;
                    }
                    for id in &d.device_ids {
                        let Some(uuid) = resolve(id, inv) else {
                            continue;
                        };
                        let r = PodRef {
                            pod: pod.name.clone(),
                            namespace: pod.namespace.clone(),
                            container: c.name.clone(),
                        };
                        let v = by_uuid.entry(uuid).or_default();
                        if !v.contains(&r) {
                            v.push(r);
                        }
                    }
                }
            }
        }
        for v in by_uuid.values_mut() {
            v.sort();
        }
        PodMap { by_uuid }
    }
}

/// The UUID of the GPU or MIG device a plugin device ID names.
fn resolve(id: &str, inv: &Inventory) -> Option<String> {
    // Time-sliced / MPS replicas: `<id>::<n>`.
    let base = id.split_once("::").map_or(id, |(b, _)| b);
    if base.starts_with("GPU-") || base.starts_with("MIG-") {
        return Some(base.to_string());
    }
    // Index naming: `<gpu>` or `<gpu>:<slot>` (MIG).
    let (gpu, slot) = match base.split_once(':') {
        Some((g, s)) => (g.parse::<u32>().ok()?, Some(s.parse::<u32>().ok()?)),
        None => (base.parse::<u32>().ok()?, None),
    };
    let g = inv.gpus.iter().find(|g| g.index == Some(gpu))?;
    match slot {
        None => g.uuid.clone(),
        Some(s) => g
            .mig_devices
            .iter()
            .find(|m| m.index == s)
            .map(|m| m.uuid.clone()),
    }
}

/// Why the pod-resources API did not answer.
#[derive(Debug, thiserror::Error)]
pub enum PodsError {
    #[error("cannot reach the kubelet's pod-resources API at {path}: {source}")]
    Dial {
        path: String,
        #[source]
        source: tonic::transport::Error,
    },
    #[error("the kubelet's pod-resources API at {path}: {status}")]
    List { path: String, status: tonic::Status },
    #[error("the kubelet's pod-resources API at {path} did not answer in {secs} s")]
    Timeout { path: String, secs: u64 },
}

/// Asks the kubelet listening on `socket` (a path in this process's
/// filesystem) which containers hold which devices.
pub async fn list(socket: &Path) -> Result<ListPodResourcesResponse, PodsError> {
    let path = socket.display().to_string();
    let call = async {
        let channel = gpu_grpc::connect(socket)
            .await
            .map_err(|source| PodsError::Dial {
                path: path.clone(),
                source,
            })?;
        PodResourcesListerClient::new(channel)
            .list(ListPodResourcesRequest {})
            .await
            .map(tonic::Response::into_inner)
            .map_err(|status| PodsError::List {
                path: path.clone(),
                status,
            })
    };
    tokio::time::timeout(LIST_TIMEOUT, call)
        .await
        .unwrap_or(Err(PodsError::Timeout {
            path: path.clone(),
            secs: LIST_TIMEOUT.as_secs(),
        }))
}

#[cfg(test)]
mod tests {
    use super::*;
    use gpu_agent_proto::podresources::v1::{ContainerDevices, ContainerResources, PodResources};

    fn pod(name: &str, resource: &str, ids: &[&str]) -> PodResources {
        PodResources {
            name: name.into(),
            namespace: "ml".into(),
            containers: vec![ContainerResources {
                name: "main".into(),
                devices: vec![ContainerDevices {
                    resource_name: resource.into(),
                    device_ids: ids.iter().map(|s| s.to_string()).collect(),
                    topology: None,
                }],
                ..Default::default()
            }],
        }
    }

    #[test]
    fn replicas_renamed_resources_index_names_and_mig_devices_resolve() {
        let (_d, sys, backend) = crate::test_support::sim_node("h100-mig-2");
        let inv = gpu_backend::discover::discover(&sys, &backend);
        let gpu1 = inv.gpus[1].uuid.clone().unwrap();
        let mig0 = inv.gpus[0].mig_devices[2].clone();
        let list = ListPodResourcesResponse {
            pod_resources: vec![
                pod("whole", "nvidia.com/gpu", &[&gpu1]),
                pod(
                    "shared-a",
                    "nvidia.com/gpu.shared",
                    &[&format!("{gpu1}::0")],
                ),
                pod("shared-b", "nvidia.com/gpu.shared", &["1::3"]),
                pod(
                    "mig",
                    "nvidia.com/mig-1g.10gb",
                    &[&format!("0:{}", mig0.index)],
                ),
                pod("other", "example.com/fpga", &["0"]),
            ],
        };
        let m = PodMap::from_list(&list, &inv);
        let names = |u: &str| m.of(u).iter().map(|p| p.pod.clone()).collect::<Vec<_>>();
        assert_eq!(names(&gpu1), ["shared-a", "shared-b", "whole"]);
        assert_eq!(names(&mig0.uuid), ["mig"]);
        assert_eq!(
            names(inv.gpus[0].uuid.as_ref().unwrap()),
            Vec::<String>::new()
        );
        assert_eq!(m.by_uuid.len(), 2);
    }
}
