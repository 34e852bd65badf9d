//! MPS sharing, as facts: where each MPS-shared resource's control daemon
//! keeps its pipe, log and shared-memory directories on the host, what it
//! is started with and told, and what a container needs to reach it.
//! Pure: the supervisor runs the daemons (`supervisor/mps.rs`), `Allocate`
//! hands out the client side ([`client_env`], [`client_mounts`]).
//!
//! Per resource (`nvidia.com/gpu`, or its rename), under the MPS root
//! (`flags.mpsRoot`, default `/run/nvidia/mps`), as NVIDIA's plugin lays
//! them out:
//! - `<root>/<resource>/pipe`: the daemon's control socket and the MPS
//!   server's pipes, where clients connect;
//! - `<root>/<resource>/log`: `control.log` and `server.log`;
//! - `<root>/shm`: shared by the daemon, its servers and every client as
//!   their `/dev/shm` (MPS clients and servers exchange shared memory).

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

use super::resources::{PluginSettings, Resource};
use gpu_model::inventory::Inventory;

/// The MPS control program on the host (the driver installs it here).
pub const CONTROL_PROGRAM: &str = "/usr/bin/nvidia-cuda-mps-control";
/// Where a container finds the MPS directories (NVIDIA's container root).
pub const CONTAINER_ROOT: &str = "/mps";
/// Where a container gets the MPS shared memory.
pub const CONTAINER_SHM: &str = "/dev/shm";
/// The search path the daemon gets (it starts `nvidia-cuda-mps-server`).
pub const DAEMON_PATH: &str = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin";
/// The command whose answer says the daemon serves (as NVIDIA's plugin checks it).
pub const HEALTH_COMMAND: &str = "get_default_active_thread_percentage";

/// `<root>/<resource>/pipe`, a host path.
pub fn pipe_dir(root: &str, resource: &str) -> String {
    format!("{}/{resource}/pipe", root.trim_end_matches('/'))
}

/// `<root>/<resource>/log`, a host path.
pub fn log_dir(root: &str, resource: &str) -> String {
    format!("{}/{resource}/log", root.trim_end_matches('/'))
}

/// `<root>/shm`, a host path: one for every resource.
pub fn shm_dir(root: &str) -> String {
    format!("{}/shm", root.trim_end_matches('/'))
}

/// `/mps/<resource>/pipe`: the pipe directory inside a container.
pub fn container_pipe_dir(resource: &str) -> String {
    format!("{CONTAINER_ROOT}/{resource}/pipe")
}

/// What a container with a replica of `resource` gets in its environment.
pub fn client_env(resource: &str) -> BTreeMap<String, String> {
    BTreeMap::from([(
        "CUDA_MPS_PIPE_DIRECTORY".to_string(),
        container_pipe_dir(resource),
    )])
}

/// A bind mount a container with a replica gets: (container path, host path).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ClientMount {
    pub container_path: String,
    pub host_path: String,
}

/// The pipe directory and the shared memory, mounted read-write (a client
/// connects to the daemon's sockets and shares memory with its server).
/// Host paths are the host's own (what the kubelet mounts), not this
/// process's view through the host root.
pub fn client_mounts(root: &str, resource: &str) -> Vec<ClientMount> {
    vec![
        ClientMount {
            container_path: container_pipe_dir(resource),
            host_path: pipe_dir(root, resource),
        },
        ClientMount {
            container_path: CONTAINER_SHM.to_string(),
            host_path: shm_dir(root),
        },
    ]
}

/// One GPU a daemon serves.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct DaemonGpu {
    pub uuid: String,
    /// NVML index.
    pub index: u32,
    /// The device number the daemon and its servers know it by: its place
    /// in the daemon's `CUDA_VISIBLE_DEVICES` (MPS renumbers the visible
    /// devices from 0, in the order listed).
    pub ordinal: u32,
    pub memory_mib: Option<u64>,
    /// A MIG device (a DRA claim's): its compute mode is its parent GPU's,
    /// which the daemon's runner leaves alone.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub mig: bool,
}

/// One MPS control daemon: the resource it serves, its GPUs and limits.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct DaemonPlan {
    /// The advertised resource (`nvidia.com/gpu`, `nvidia.com/gpu.shared`).
    pub resource: String,
    /// The MPS root on the host.
    pub root: String,
    /// Its GPUs by NVML index.
    pub gpus: Vec<DaemonGpu>,
    /// Replicas of each GPU (clients one GPU is divided between).
    pub replicas: u32,
    /// Limits set explicitly (a DRA claim's `mpsConfig`), in place of
    /// those derived from `replicas`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub explicit: Option<ExplicitLimits>,
    /// A shared-memory directory of its own (a host path), in place of the
    /// root's `shm` that every resource of the device plugin shares.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub shm: Option<String>,
    /// Started in multi-user mode (`-M`: clients of any user; a DRA
    /// claim's `mpsConfig.multiUser`).
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub multi_user: bool,
}

/// What a daemon is told when its limits are set explicitly (NVIDIA's DRA
/// `MpsConfig`): only what is set is sent.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct ExplicitLimits {
    /// `set_default_active_thread_percentage`, when set.
    pub thread_percentage: Option<u32>,
    /// `set_default_device_pinned_mem_limit`, in MiB, by the GPU's ordinal.
    pub pinned_mib: BTreeMap<u32, u64>,
}

impl DaemonPlan {
    pub fn pipe_dir(&self) -> String {
        pipe_dir(&self.root, &self.resource)
    }

    pub fn log_dir(&self) -> String {
        log_dir(&self.root, &self.resource)
    }

    pub fn shm_dir(&self) -> String {
        self.shm.clone().unwrap_or_else(|| shm_dir(&self.root))
    }

    /// The daemon's (and its clients' on the host) whole environment:
    /// its directories, and only this resource's GPUs visible, by UUID.
    pub fn env(&self) -> BTreeMap<String, String> {
        let uuids: Vec<&str> = self.gpus.iter().map(|g| g.uuid.as_str()).collect();
        BTreeMap::from([
            ("CUDA_MPS_PIPE_DIRECTORY".to_string(), self.pipe_dir()),
            ("CUDA_MPS_LOG_DIRECTORY".to_string(), self.log_dir()),
            ("CUDA_VISIBLE_DEVICES".to_string(), uuids.join(",")),
            ("PATH".to_string(), DAEMON_PATH.to_string()),
        ])
    }

    /// Each client's share of the GPU's threads, in percent (as NVIDIA's
    /// plugin: 100 / replicas, rounded down; explicit limits: as set, or
    /// 100 when not set).
    pub fn thread_percentage(&self) -> u32 {
        match &self.explicit {
            Some(e) => e.thread_percentage.unwrap_or(100),
            None => 100 / self.replicas.max(1),
        }
    }

    /// What the daemon is told once it answers, in order: each client's
    /// thread share, then each GPU's pinned-memory limit per client (its
    /// memory divided by the replicas, in MiB, rounded down; GPUs whose
    /// memory NVML did not report get none).
    /// With explicit limits: only those set, in the same order.
    pub fn setup_commands(&self) -> Vec<String> {
        if let Some(e) = &self.explicit {
            let mut out: Vec<String> = e
                .thread_percentage
                .iter()
                .map(|p| format!("set_default_active_thread_percentage {p}"))
                .collect();
            for (ordinal, mib) in &e.pinned_mib {
                out.push(format!(
                    "set_default_device_pinned_mem_limit {ordinal} {mib}M"
                ));
            }
            return out;
        }
        let mut out = vec![format!(
            "set_default_active_thread_percentage {}",
            self.thread_percentage()
        )];
        for g in &self.gpus {
            if let Some(mib) = g.memory_mib.filter(|m| *m > 0) {
                out.push(format!(
                    "set_default_device_pinned_mem_limit {} {}M",
                    g.ordinal,
                    mib / u64::from(self.replicas.max(1))
                ));
            }
        }
        out
    }

    /// `nvidia.com/gpu: GPUs 0,1 in 4 replicas`, for logs and status.
    pub fn summary(&self) -> String {
        let idx: Vec<String> = self.gpus.iter().map(|g| g.index.to_string()).collect();
        format!(
            "{}: GPU(s) {} in {} replicas",
            self.resource,
            idx.join(","),
            self.replicas
        )
    }
}

/// One daemon per MPS-shared resource, its GPUs in NVML-index order. The
/// resources come from [`super::resources::build`], which refuses MPS where
/// it cannot run and gives every GPU of one MPS resource the same replica
/// count.
pub fn plans(
    settings: &PluginSettings,
    resources: &[Resource],
    inv: &Inventory,
) -> Vec<DaemonPlan> {
    let mut out = Vec::new();
    for r in resources.iter().filter(|r| r.mps) {
        let mut per_gpu: BTreeMap<u32, (String, u32)> = BTreeMap::new();
        for d in &r.devices {
            per_gpu
                .entry(d.index)
                .or_insert_with(|| (d.gpu_uuid.clone(), 0))
                .1 += 1;
        }
        let replicas = per_gpu.values().map(|(_, n)| *n).max().unwrap_or(1);
        let gpus = per_gpu
            .into_iter()
            .enumerate()
            .map(|(ordinal, (index, (uuid, _)))| DaemonGpu {
                memory_mib: inv
                    .gpus
                    .iter()
                    .find(|g| g.uuid.as_deref() == Some(uuid.as_str()))
                    .and_then(|g| g.memory_mib),
                uuid,
                index,
                ordinal: ordinal as u32,
                mig: false,
            })
            .collect();
        out.push(DaemonPlan {
            resource: r.name.clone(),
            root: settings.mps_root.clone(),
            gpus,
            replicas,
            explicit: None,
            shm: None,
            multi_user: false,
        });
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::{MigStrategy, PluginConfig};
    use crate::resources::build;
    use crate::test_support::inventory_of;

    fn settings(yaml: &str) -> PluginSettings {
        let c = PluginConfig::from_yaml(yaml, "c").unwrap();
        PluginSettings {
            mig_strategy: MigStrategy::Single,
            mps: c.sharing.mps,
            mps_root: c
                .flags
                .mps_root
                .unwrap_or_else(|| super::super::resources::DEFAULT_MPS_ROOT.into()),
            ..PluginSettings::default()
        }
    }

    #[test]
    fn one_daemon_per_resource_with_its_gpus_limits_and_env() {
        let s = settings(
            "version: v1\nsharing:\n  mps:\n    resources:\n    - {name: nvidia.com/gpu, devices: [2, 3], replicas: 4, rename: gpu.mps}\n    - {name: nvidia.com/gpu, devices: [0], replicas: 3, rename: gpu.third}\n",
        );
        let inv = inventory_of("h100-sxm-8");
        let rs = build(&inv, &s).unwrap();
        let ps = plans(&s, &rs, &inv);
        assert_eq!(ps.len(), 2);
        let p = &ps[0];
        assert_eq!(p.resource, "nvidia.com/gpu.mps");
        assert_eq!(p.summary(), "nvidia.com/gpu.mps: GPU(s) 2,3 in 4 replicas");
        assert_eq!(p.pipe_dir(), "/run/nvidia/mps/nvidia.com/gpu.mps/pipe");
        assert_eq!(p.log_dir(), "/run/nvidia/mps/nvidia.com/gpu.mps/log");
        assert_eq!(p.shm_dir(), "/run/nvidia/mps/shm");
        let env = p.env();
        assert_eq!(
            env["CUDA_VISIBLE_DEVICES"],
            format!(
                "{},{}",
                inv.gpus[2].uuid.as_deref().unwrap(),
                inv.gpus[3].uuid.as_deref().unwrap()
            )
        );
        assert_eq!(env["CUDA_MPS_PIPE_DIRECTORY"], p.pipe_dir());
        assert_eq!(env["CUDA_MPS_LOG_DIRECTORY"], p.log_dir());
        // 81559 MiB H100s: 20389 MiB per client; GPUs 2 and 3 are the
        // daemon's devices 0 and 1.
        assert_eq!(
            p.setup_commands(),
            [
                "set_default_active_thread_percentage 25",
                "set_default_device_pinned_mem_limit 0 20389M",
                "set_default_device_pinned_mem_limit 1 20389M",
            ]
        );
        assert_eq!(
            ps[1].setup_commands(),
            [
                "set_default_active_thread_percentage 33",
                "set_default_device_pinned_mem_limit 0 27186M",
            ]
        );
    }

    #[test]
    fn client_side_as_nvidia_hands_it_out() {
        assert_eq!(
            client_env("nvidia.com/gpu")["CUDA_MPS_PIPE_DIRECTORY"],
            "/mps/nvidia.com/gpu/pipe"
        );
        assert_eq!(
            client_mounts("/var/run/mps/", "nvidia.com/gpu"),
            [
                ClientMount {
                    container_path: "/mps/nvidia.com/gpu/pipe".into(),
                    host_path: "/var/run/mps/nvidia.com/gpu/pipe".into()
                },
                ClientMount {
                    container_path: "/dev/shm".into(),
                    host_path: "/var/run/mps/shm".into()
                },
            ]
        );
    }

    #[test]
    fn explicit_limits_and_an_own_shm_replace_the_derived_ones() {
        let gpu = |ordinal: u32| DaemonGpu {
            uuid: format!("GPU-{ordinal}"),
            index: ordinal + 4,
            ordinal,
            memory_mib: Some(81559),
            mig: false,
        };
        let mut p = DaemonPlan {
            resource: "dra-claim-abc".into(),
            root: "/run/nvidia/mps".into(),
            gpus: vec![gpu(0), gpu(1)],
            replicas: 1,
            explicit: Some(ExplicitLimits {
                thread_percentage: Some(40),
                pinned_mib: BTreeMap::from([(1, 2048)]),
            }),
            shm: Some("/run/nvidia/mps/dra-claim-abc/shm".into()),
            multi_user: false,
        };
        assert_eq!(
            p.setup_commands(),
            [
                "set_default_active_thread_percentage 40",
                "set_default_device_pinned_mem_limit 1 2048M",
            ]
        );
        assert_eq!(p.thread_percentage(), 40);
        assert_eq!(p.shm_dir(), "/run/nvidia/mps/dra-claim-abc/shm");
        assert_eq!(p.pipe_dir(), "/run/nvidia/mps/dra-claim-abc/pipe");
        // Nothing set: nothing sent (the daemon's own defaults).
        p.explicit = Some(ExplicitLimits::default());
        assert!(p.setup_commands().is_empty());
        assert_eq!(p.thread_percentage(), 100);
    }

    #[test]
    fn time_slicing_and_whole_gpus_run_no_daemon() {
        let inv = inventory_of("t4-4");
        let s = PluginSettings::default();
        assert!(plans(&s, &build(&inv, &s).unwrap(), &inv).is_empty());
    }
}
