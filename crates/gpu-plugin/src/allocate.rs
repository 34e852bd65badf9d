//! `Allocate`: what the container runtime is told about the devices a
//! container got, by the configured device-list strategies, and for MPS
//! replicas how to reach the resource's MPS control daemon.

use std::collections::BTreeSet;

use gpu_agent_proto::deviceplugin::v1beta1::{
    CdiDevice, ContainerAllocateResponse, DeviceSpec, Mount,
};
use hostlib::HostRoot;

use super::config::{DeviceIdStrategy, DeviceListStrategy};
use super::resources::{PluginDevice, PluginSettings, Resource};
pub use gpu_model::cdi::CDI_KIND;

/// Where the volume-mounts strategy lists devices inside the container.
pub const VOLUME_MOUNT_DIR: &str = "/var/run/nvidia-container-devices";
/// Control nodes passed with `passDeviceSpecs` when they exist.
pub const CONTROL_NODES: &[&str] = &[
    "/dev/nvidiactl",
    "/dev/nvidia-uvm",
    "/dev/nvidia-uvm-tools",
    "/dev/nvidia-modeset",
];

/// The longest device ID taken in a request, in bytes. Ours are at most
/// about 60 (`GPU-<UUID>::<replica>`, `MIG-<UUID>`); a longer one cannot
/// match and is refused before it is compared, logged or echoed.
pub const MAX_ID_BYTES: usize = 256;

/// A request the plugin refuses; nothing is allocated.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum AllocateError {
    #[error("{resource}: unknown device ID {id:?}")]
    Unknown { resource: String, id: String },
    #[error("{resource}: device ID {id:?} requested twice")]
    Duplicate { resource: String, id: String },
    /// More IDs than the resource advertises (replicas included): no
    /// request the kubelet makes can be larger.
    #[error(
        "{resource}: {asked} device IDs in one {what}; this resource advertises {limit}, the most a request can name"
    )]
    TooManyIds {
        resource: String,
        what: &'static str,
        asked: usize,
        limit: usize,
    },
    #[error(
        "{resource}: {asked} container requests in one {what}; at most {limit} (one device each, {limit} devices advertised)"
    )]
    TooManyContainers {
        resource: String,
        what: &'static str,
        asked: usize,
        limit: usize,
    },
    #[error(
        "{resource}: a device ID of {len} bytes ({prefix:?}...); device IDs are at most {MAX_ID_BYTES} bytes"
    )]
    IdTooLong {
        resource: String,
        len: usize,
        prefix: String,
    },
    #[error("{resource}: empty request")]
    Empty { resource: String },
    /// `failRequestsGreaterThanOne`: NVIDIA's words, and the key.
    #[error(
        "{resource}: maximum request size for shared resources is 1 (asked for {asked}; failRequestsGreaterThanOne)"
    )]
    TooManyShared { resource: String, asked: usize },
}

/// Checks the size of a whole request before anything in it is looked at:
/// `containers` is its container requests' count and `lists` every list of
/// device IDs in it (`what` names the call in the error). No request the
/// kubelet makes names more containers or IDs than the resource
/// advertises, nor an ID longer than [`MAX_ID_BYTES`].
pub fn check_size<'a>(
    resource: &Resource,
    what: &'static str,
    containers: usize,
    lists: impl IntoIterator<Item = &'a [String]>,
) -> Result<(), AllocateError> {
    let limit = resource.devices.len();
    if containers > limit.max(1) {
        return Err(AllocateError::TooManyContainers {
            resource: resource.name.clone(),
            what,
            asked: containers,
            limit,
        });
    }
    let mut asked = 0usize;
    for list in lists {
        asked += list.len();
        if let Some(long) = list.iter().find(|id| id.len() > MAX_ID_BYTES) {
            return Err(AllocateError::IdTooLong {
                resource: resource.name.clone(),
                len: long.len(),
                prefix: long.chars().take(32).collect(),
            });
        }
    }
    if asked > limit {
        return Err(AllocateError::TooManyIds {
            resource: resource.name.clone(),
            what,
            asked,
            limit,
        });
    }
    Ok(())
}

/// Checks a container's requested IDs against the resource and returns its
/// devices in request order.
pub fn validate<'r>(
    resource: &'r Resource,
    ids: &[String],
) -> Result<Vec<&'r PluginDevice>, AllocateError> {
    if ids.is_empty() {
        return Err(AllocateError::Empty {
            resource: resource.name.clone(),
        });
    }
    check_size(resource, "container request", 1, [ids])?;
    let mut seen = BTreeSet::new();
    let mut out = Vec::with_capacity(ids.len());
    for id in ids {
        if !seen.insert(id.as_str()) {
            return Err(AllocateError::Duplicate {
                resource: resource.name.clone(),
                id: id.clone(),
            });
        }
        let dev = resource
            .devices
            .iter()
            .find(|d| &d.id == id)
            .ok_or_else(|| AllocateError::Unknown {
                resource: resource.name.clone(),
                id: id.clone(),
            })?;
        out.push(dev);
    }
    if resource.shared && resource.fail_requests_greater_than_one && ids.len() > 1 {
        return Err(AllocateError::TooManyShared {
            resource: resource.name.clone(),
            asked: ids.len(),
        });
    }
    Ok(out)
}

/// The response for one container. `dev_root` is where device nodes are on
/// the host (control nodes that do not exist there are skipped).
pub fn container_response(
    resource: &Resource,
    settings: &PluginSettings,
    dev_root: &HostRoot,
    ids: &[String],
) -> Result<ContainerAllocateResponse, AllocateError> {
    let devices = validate(resource, ids)?;
    // Replicas of one GPU name the same GPU: each GPU once, in request order.
    let mut gpus: Vec<&PluginDevice> = Vec::new();
    for d in devices {
        if !gpus.iter().any(|g| g.uuid == d.uuid) {
            gpus.push(d);
        }
    }
    let runtime_ids: Vec<String> = gpus
        .iter()
        .map(|g| match settings.id_strategy {
            DeviceIdStrategy::Uuid => g.uuid.clone(),
            DeviceIdStrategy::Index => g.index_name.clone(),
        })
        .collect();
    let mut resp = ContainerAllocateResponse::default();
    let strategies = &settings.list_strategies;
    let cdi_names: Vec<String> = runtime_ids
        .iter()
        .map(|id| format!("{CDI_KIND}={id}"))
        .collect();
    if strategies.contains(&DeviceListStrategy::CdiAnnotations) {
        let short = resource
            .name
            .strip_prefix("nvidia.com/")
            .unwrap_or(&resource.name);
        resp.annotations.insert(
            format!("{}gpu-agent_{short}", settings.cdi_annotation_prefix),
            cdi_names.join(","),
        );
    }
    if strategies.contains(&DeviceListStrategy::CdiCri) {
        resp.cdi_devices = cdi_names
            .iter()
            .map(|name| CdiDevice { name: name.clone() })
            .collect();
    }
    if strategies.contains(&DeviceListStrategy::Envvar) {
        resp.envs
            .insert("NVIDIA_VISIBLE_DEVICES".into(), runtime_ids.join(","));
    }
    if strategies.contains(&DeviceListStrategy::VolumeMounts) {
        resp.envs
            .insert("NVIDIA_VISIBLE_DEVICES".into(), VOLUME_MOUNT_DIR.into());
        for id in &runtime_ids {
            resp.mounts.push(Mount {
                container_path: format!("{VOLUME_MOUNT_DIR}/{id}"),
                host_path: "/dev/null".into(),
                read_only: true,
            });
        }
    }
    if resource.mps {
        // What NVIDIA's plugin hands out, whatever the device-list strategy:
        // the pipe directory where the client finds the daemon, and the
        // shared memory its server uses. The thread and memory limits are
        // the daemon's defaults, so no CUDA_MPS_* limit variable is set.
        resp.envs.extend(super::mps::client_env(&resource.name));
        for m in super::mps::client_mounts(&settings.mps_root, &resource.name) {
            resp.mounts.push(Mount {
                container_path: m.container_path,
                host_path: m.host_path,
                read_only: false,
            });
        }
    }
    if settings.pass_device_specs {
        let spec = |path: &str| DeviceSpec {
            container_path: path.to_string(),
            host_path: dev_root
                .resolve(path)
                .map_or_else(|_| path.to_string(), |p| p.display().to_string()),
            permissions: "rw".into(),
        };
        for node in CONTROL_NODES {
            if dev_root.exists(node) {
                resp.devices.push(spec(node));
            }
        }
        for g in &gpus {
            if let Some(minor) = g.minor {
                resp.devices.push(spec(&format!("/dev/nvidia{minor}")));
            }
        }
    }
    Ok(resp)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::resources::{PluginSettings, build};
    use crate::test_support::inventory_of;

    fn gpu_resource() -> Resource {
        build(&inventory_of("h100-sxm-8"), &PluginSettings::default())
            .unwrap()
            .remove(0)
    }

    fn ids(r: &Resource, idx: &[usize]) -> Vec<String> {
        idx.iter().map(|&i| r.devices[i].id.clone()).collect()
    }

    #[test]
    fn envvar_with_uuids() {
        let r = gpu_resource();
        let root = HostRoot::system();
        let resp =
            container_response(&r, &PluginSettings::default(), &root, &ids(&r, &[2, 0])).unwrap();
        assert_eq!(
            resp.envs["NVIDIA_VISIBLE_DEVICES"],
            "GPU-7c1f9e2d-3b4a-4d8e-a1f3-2b3c4d5e6f03,GPU-9d3b5a0e-1c7f-4e2a-8b61-0f2c3d4e5a01"
        );
        assert!(resp.mounts.is_empty() && resp.devices.is_empty() && resp.cdi_devices.is_empty());
    }

    #[test]
    fn cdi_strategies_only_set_no_env() {
        let r = gpu_resource();
        let s = PluginSettings {
            list_strategies: vec![
                DeviceListStrategy::CdiAnnotations,
                DeviceListStrategy::CdiCri,
            ],
            id_strategy: DeviceIdStrategy::Index,
            ..PluginSettings::default()
        };
        let resp = container_response(&r, &s, &HostRoot::system(), &ids(&r, &[1, 3])).unwrap();
        assert!(resp.envs.is_empty());
        assert_eq!(
            resp.annotations["cdi.k8s.io/gpu-agent_gpu"],
            "nvidia.com/gpu=1,nvidia.com/gpu=3"
        );
        let names: Vec<&str> = resp.cdi_devices.iter().map(|d| d.name.as_str()).collect();
        assert_eq!(names, ["nvidia.com/gpu=1", "nvidia.com/gpu=3"]);
    }

    #[test]
    fn volume_mounts() {
        let r = gpu_resource();
        let s = PluginSettings {
            list_strategies: vec![DeviceListStrategy::VolumeMounts],
            id_strategy: DeviceIdStrategy::Index,
            ..PluginSettings::default()
        };
        let resp = container_response(&r, &s, &HostRoot::system(), &ids(&r, &[4])).unwrap();
        assert_eq!(resp.envs["NVIDIA_VISIBLE_DEVICES"], VOLUME_MOUNT_DIR);
        assert_eq!(
            resp.mounts,
            vec![Mount {
                container_path: "/var/run/nvidia-container-devices/4".into(),
                host_path: "/dev/null".into(),
                read_only: true
            }]
        );
    }

    #[test]
    fn pass_device_specs_skips_missing_control_nodes() {
        let r = gpu_resource();
        let dir = tempfile::tempdir().unwrap();
        std::fs::create_dir_all(dir.path().join("dev")).unwrap();
        for n in ["nvidiactl", "nvidia-uvm", "nvidia3"] {
            std::fs::write(dir.path().join("dev").join(n), "").unwrap();
        }
        let root = HostRoot::new(dir.path()).unwrap();
        let s = PluginSettings {
            pass_device_specs: true,
            ..PluginSettings::default()
        };
        let resp = container_response(&r, &s, &root, &ids(&r, &[3])).unwrap();
        let paths: Vec<(&str, bool)> = resp
            .devices
            .iter()
            .map(|d| {
                (
                    d.container_path.as_str(),
                    d.host_path.starts_with(root.path().to_str().unwrap()),
                )
            })
            .collect();
        assert_eq!(
            paths,
            [
                ("/dev/nvidiactl", true),
                ("/dev/nvidia-uvm", true),
                ("/dev/nvidia3", true)
            ]
        );
        assert!(resp.devices.iter().all(|d| d.permissions == "rw"));
    }

    #[test]
    fn bad_requests_name_the_id() {
        let r = gpu_resource();
        let root = HostRoot::system();
        let s = PluginSettings::default();
        let err = container_response(&r, &s, &root, &["GPU-nope".into()]).unwrap_err();
        assert_eq!(
            err.to_string(),
            "nvidia.com/gpu: unknown device ID \"GPU-nope\""
        );
        let twice = vec![r.devices[0].id.clone(), r.devices[0].id.clone()];
        assert!(matches!(
            container_response(&r, &s, &root, &twice),
            Err(AllocateError::Duplicate { .. })
        ));
        assert!(matches!(
            container_response(&r, &s, &root, &[]),
            Err(AllocateError::Empty { .. })
        ));
    }

    #[test]
    fn oversized_requests_are_refused_naming_count_and_limit() {
        let r = gpu_resource();
        let root = HostRoot::system();
        let s = PluginSettings::default();
        let many: Vec<String> = (0..100_000).map(|i| format!("GPU-{i}")).collect();
        let err = container_response(&r, &s, &root, &many).unwrap_err();
        assert_eq!(
            err.to_string(),
            "nvidia.com/gpu: 100000 device IDs in one container request; this resource advertises 8, the most a request can name"
        );
        // Nine copies of one ID: too many before they are found twice.
        let dup = vec![r.devices[0].id.clone(); 9];
        assert!(matches!(
            container_response(&r, &s, &root, &dup),
            Err(AllocateError::TooManyIds {
                asked: 9,
                limit: 8,
                ..
            })
        ));
        let long = "G".repeat(1 << 20);
        let err = container_response(&r, &s, &root, &[long]).unwrap_err();
        assert_eq!(
            err.to_string(),
            format!(
                "nvidia.com/gpu: a device ID of 1048576 bytes (\"{}\"...); device IDs are at most 256 bytes",
                "G".repeat(32)
            )
        );
        // Across a whole request: containers and IDs together.
        let one = [r.devices[0].id.clone()];
        let lists = [&one[..]; 9];
        assert!(matches!(
            check_size(&r, "Allocate", 9, lists.iter().copied()),
            Err(AllocateError::TooManyContainers {
                asked: 9,
                limit: 8,
                ..
            })
        ));
        let all: Vec<String> = r.devices.iter().map(|d| d.id.clone()).collect();
        assert_eq!(
            check_size(&r, "Allocate", 2, [&all[..4], &all[4..]]),
            Ok(())
        );
        assert!(matches!(
            check_size(&r, "Allocate", 2, [&all[..], &all[..1]]),
            Err(AllocateError::TooManyIds { asked: 9, .. })
        ));
    }

    #[test]
    fn replicas_map_to_their_gpu_once_and_may_be_limited_to_one() {
        let config = crate::config::PluginConfig::from_yaml(
            "version: v1\nsharing:\n  timeSlicing:\n    failRequestsGreaterThanOne: true\n    resources:\n    - {name: nvidia.com/gpu, replicas: 4}\n",
            "c",
        )
        .unwrap();
        let s = PluginSettings {
            time_slicing: config.sharing.time_slicing,
            ..PluginSettings::default()
        };
        let mut r = build(&inventory_of("t4-4"), &s).unwrap().remove(0);
        let err = container_response(&r, &s, &HostRoot::system(), &ids(&r, &[0, 1])).unwrap_err();
        assert_eq!(
            err.to_string(),
            "nvidia.com/gpu: maximum request size for shared resources is 1 (asked for 2; failRequestsGreaterThanOne)"
        );
        r.fail_requests_greater_than_one = false;
        let resp = container_response(&r, &s, &HostRoot::system(), &ids(&r, &[0, 1, 5])).unwrap();
        assert_eq!(
            resp.envs["NVIDIA_VISIBLE_DEVICES"],
            "GPU-5f0cf4a3-6a1c-5c37-a7a5-5e54ae0c9a40,GPU-5f0cf4a3-6a1c-5c37-a7a5-5e54ae0c9a41"
        );
    }

    fn mps(
        yaml_resources: &str,
        strategies: Vec<DeviceListStrategy>,
    ) -> (Resource, PluginSettings) {
        let config = crate::config::PluginConfig::from_yaml(
            &format!("version: v1\nsharing:\n  mps:\n{yaml_resources}"),
            "c",
        )
        .unwrap();
        let s = PluginSettings {
            mps: config.sharing.mps,
            list_strategies: strategies,
            ..PluginSettings::default()
        };
        let r = build(&inventory_of("t4-4"), &s).unwrap().remove(0);
        (r, s)
    }

    #[test]
    fn mps_replica_gets_the_pipe_directory_and_shm() {
        let (r, s) = mps(
            "    resources:\n    - {name: nvidia.com/gpu, replicas: 4}\n",
            vec![DeviceListStrategy::Envvar],
        );
        let resp = container_response(&r, &s, &HostRoot::system(), &ids(&r, &[5])).unwrap();
        assert_eq!(
            resp.envs,
            std::collections::HashMap::from([
                (
                    "NVIDIA_VISIBLE_DEVICES".to_string(),
                    "GPU-5f0cf4a3-6a1c-5c37-a7a5-5e54ae0c9a41".to_string()
                ),
                (
                    "CUDA_MPS_PIPE_DIRECTORY".to_string(),
                    "/mps/nvidia.com/gpu/pipe".to_string()
                ),
            ])
        );
        assert_eq!(
            resp.mounts,
            vec![
                Mount {
                    container_path: "/mps/nvidia.com/gpu/pipe".into(),
                    host_path: "/run/nvidia/mps/nvidia.com/gpu/pipe".into(),
                    read_only: false
                },
                Mount {
                    container_path: "/dev/shm".into(),
                    host_path: "/run/nvidia/mps/shm".into(),
                    read_only: false
                },
            ]
        );
        assert!(resp.devices.is_empty());
    }

    /// With CDI only, the MPS facts still come (NVIDIA's plugin adds them
    /// whatever the strategy); a renamed resource has its own directory.
    #[test]
    fn mps_with_cdi_and_a_rename() {
        let (r, s) = mps(
            "    resources:\n    - {name: nvidia.com/gpu, replicas: 2, rename: gpu.mps}\n",
            vec![DeviceListStrategy::CdiCri],
        );
        let resp = container_response(&r, &s, &HostRoot::system(), &ids(&r, &[0])).unwrap();
        assert_eq!(resp.envs.len(), 1);
        assert_eq!(
            resp.envs["CUDA_MPS_PIPE_DIRECTORY"],
            "/mps/nvidia.com/gpu.mps/pipe"
        );
        assert_eq!(resp.cdi_devices.len(), 1);
        assert_eq!(
            resp.mounts[0].host_path,
            "/run/nvidia/mps/nvidia.com/gpu.mps/pipe"
        );
    }

    /// MPS refuses two replicas in one request unless the config allows it.
    #[test]
    fn mps_fail_requests_greater_than_one() {
        let (r, s) = mps(
            "    resources:\n    - {name: nvidia.com/gpu, replicas: 4}\n",
            vec![DeviceListStrategy::Envvar],
        );
        let err = container_response(&r, &s, &HostRoot::system(), &ids(&r, &[0, 4])).unwrap_err();
        assert!(
            matches!(err, AllocateError::TooManyShared { asked: 2, .. }),
            "{err}"
        );
        let (r, s) = mps(
            "    failRequestsGreaterThanOne: false\n    resources:\n    - {name: nvidia.com/gpu, replicas: 4}\n",
            vec![DeviceListStrategy::Envvar],
        );
        let resp = container_response(&r, &s, &HostRoot::system(), &ids(&r, &[0, 4])).unwrap();
        assert_eq!(resp.envs["NVIDIA_VISIBLE_DEVICES"].split(',').count(), 2);
        assert_eq!(resp.mounts.len(), 2);
    }
}
