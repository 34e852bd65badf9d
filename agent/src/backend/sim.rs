//! The simulated backend: answers from a node description.

use std::sync::{Arc, Mutex};

use simnode::NodeDescription;

use super::{
    BackendError, BackendGpu, BackendSnapshot, ComputeCapability, CudaVersion, GpuBackend,
    HealthEvent, HealthSender, MigDevice, MigMode, PcieLevel, Telemetry, mig_profile_name,
};

/// Serves a [`NodeDescription`]. Health events are injected with
/// [`SimulatedBackend::inject`].
#[derive(Debug, Clone)]
pub struct SimulatedBackend {
    node: NodeDescription,
    watchers: Arc<Mutex<Vec<HealthSender>>>,
}

impl SimulatedBackend {
    pub fn new(node: NodeDescription) -> Self {
        SimulatedBackend {
            node,
            watchers: Arc::default(),
        }
    }

    /// Sends `event` to every health watcher; returns how many got it.
    pub fn inject(&self, event: HealthEvent) -> usize {
        let mut watchers = self.watchers.lock().unwrap();
        watchers.retain(|w| w.send(event.clone()).is_ok());
        watchers.len()
    }

    pub fn node(&self) -> &NodeDescription {
        &self.node
    }
}

impl GpuBackend for SimulatedBackend {
    fn name(&self) -> &'static str {
        "simulated"
    }

    fn watch_health(&self, events: HealthSender) -> Result<(), BackendError> {
        self.watchers.lock().unwrap().push(events);
        Ok(())
    }

    fn snapshot(&self) -> Result<BackendSnapshot, BackendError> {
        let n = &self.node;
        let Some(driver) = &n.driver else {
            return Err(BackendError::DriverNotLoaded(format!(
                "the simulated node {:?} has no driver",
                n.name
            )));
        };
        let gpus = n
            .gpus
            .iter()
            .enumerate()
            .map(|(i, g)| BackendGpu {
                index: i as u32,
                uuid: g.uuid.clone(),
                name: g.name.clone(),
                bus_id: g.bus_id,
                memory_total_mib: Some(g.memory_mib),
                compute_capability: g
                    .compute_capability()
                    .map(|(major, minor)| ComputeCapability { major, minor }),
                mig: g.mig.capable.then_some(MigMode {
                    current: g.mig.enabled,
                    pending: g.mig.enabled,
                }),
                nvlink_remotes: NodeDescription::nvlink_remotes(g),
                telemetry: Telemetry {
                    temperature_c: g.telemetry.temperature_c,
                    power_mw: g.telemetry.power_mw,
                    utilization_gpu_pct: g
                        .telemetry
                        .utilization_gpu
                        .filter(|_| g.telemetry.utilization_memory.is_some()),
                    utilization_memory_pct: g
                        .telemetry
                        .utilization_memory
                        .filter(|_| g.telemetry.utilization_gpu.is_some()),
                    memory_used_mib: Some(g.memory_used_mib),
                    // As the fake libnvidia-ml answers for the same node.
                    slowdown_temperature_c: Some(simnode::SLOWDOWN_TEMPERATURE_C),
                    retired_pages_pending: Some(false),
                    remapped_rows_pending: Some(false),
                },
                mig_devices: if g.mig.enabled {
                    g.mig
                        .devices
                        .iter()
                        .enumerate()
                        .map(|(k, m)| MigDevice {
                            index: k as u32,
                            uuid: m.uuid.clone(),
                            profile: mig_profile_name(
                                m.gi_slices,
                                m.ci_slices(),
                                m.memory_mib,
                                g.memory_mib,
                            ),
                            gi_slices: m.gi_slices,
                            ci_slices: m.ci_slices(),
                            memory_mib: m.memory_mib,
                            multiprocessors: m.multiprocessors,
                            gpu_instance_id: Some(m.gi_id(k)),
                            compute_instance_id: Some(m.ci_id()),
                        })
                        .collect()
                } else {
                    Vec::new()
                },
            })
            .collect();
        let mut pcie = Vec::new();
        for a in 0..n.gpus.len() {
            for b in (a + 1)..n.gpus.len() {
                let level =
                    PcieLevel::from_nvml(n.pcie_level(a, b)).expect("simnode returns NVML levels");
                pcie.push((a as u32, b as u32, level));
            }
        }
        Ok(BackendSnapshot {
            lost: Vec::new(),
            driver_version: Some(driver.version.clone()),
            cuda_version: driver.cuda_version_int().and_then(CudaVersion::from_nvml),
            gpus,
            pcie,
        })
    }
}
