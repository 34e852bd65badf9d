//! The simulated backend: answers from a node description.

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};

use simnode::NodeDescription;
use simnode::mig::state::GpuMig;

use super::{
    BackendError, BackendGpu, BackendSnapshot, ComputeCapability, ComputeMode, CudaVersion,
    GpuBackend, GpuFabric, HealthEvent, HealthSender, MigDevice, MigEngines, MigMode, PcieLevel,
    Telemetry, mig_profile_name,
};

/// Serves a [`NodeDescription`]. Health events are injected with
/// [`SimulatedBackend::inject`].
#[derive(Debug, Clone)]
pub struct SimulatedBackend {
    node: NodeDescription,
    watchers: Arc<Mutex<Vec<HealthSender>>>,
    /// Compute modes set, by UUID (every GPU starts in `Default`).
    compute_modes: Arc<Mutex<std::collections::BTreeMap<String, ComputeMode>>>,
}

impl SimulatedBackend {
    pub fn new(node: NodeDescription) -> Self {
        SimulatedBackend {
            node,
            watchers: Arc::default(),
            compute_modes: Arc::default(),
        }
    }

    fn known(&self, uuid: &str) -> Result<(), BackendError> {
        if self.node.gpus.iter().any(|g| g.uuid == uuid) {
            Ok(())
        } else {
            Err(BackendError::Unavailable(format!(
                "the simulated node has no GPU {uuid}"
            )))
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

    fn set_compute_mode(&self, uuid: &str, mode: ComputeMode) -> Result<(), BackendError> {
        self.known(uuid)?;
        self.compute_modes
            .lock()
            .unwrap()
            .insert(uuid.to_string(), mode);
        Ok(())
    }

    fn compute_mode(&self, uuid: &str) -> Result<ComputeMode, BackendError> {
        self.known(uuid)?;
        Ok(self
            .compute_modes
            .lock()
            .unwrap()
            .get(uuid)
            .copied()
            .unwrap_or(ComputeMode::Default))
    }

    fn sampler(&self) -> Result<Box<dyn super::Sampler>, BackendError> {
        Ok(Box::new(SimSampler {
            node: self.node.clone(),
            started: std::time::Instant::now(),
        }))
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
            .map(|(i, g)| (i, g, mig_placements(g)))
            .map(|(i, g, placed)| BackendGpu {
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
                            gi_profile_id: placed.get(&m.uuid).map(|p| p.0),
                            placement_start: placed.get(&m.uuid).map(|p| p.1),
                            engines: {
                                let e = m.engines();
                                MigEngines {
                                    copy: e.copy,
                                    decoder: e.decoder,
                                    encoder: e.encoder,
                                    jpeg: e.jpeg,
                                    ofa: e.ofa,
                                }
                            },
                        })
                        .collect()
                } else {
                    Vec::new()
                },
                fabric: g.fabric.as_ref().and_then(|f| {
                    GpuFabric::from_nvml(
                        f.cluster_uuid_bytes()?,
                        f.status,
                        f.clique_id,
                        f.state.nvml(),
                    )
                }),
                // As the fake libnvidia-ml answers for the same node.
                brand: gpu_model::nvlib::brand_name(g.board().brand).map(str::to_string),
                architecture: gpu_model::nvlib::architecture_name(g.board().architecture)
                    .map(str::to_string),
                notes: Vec::new(),
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

/// Each described MIG device's GPU-instance profile ID and placement start,
/// by UUID: where simnode's MIG state (which the fake libnvidia-ml serves
/// for the same description) places it. Empty while MIG is off, and when
/// the devices do not fit on the GPU together (the fake refuses such a
/// description; here the two facts are just left out).
fn mig_placements(g: &simnode::GpuDesc) -> BTreeMap<String, (u32, u32)> {
    if !g.mig.enabled || g.mig.devices.is_empty() {
        return BTreeMap::new();
    }
    match GpuMig::from_desc(g) {
        Ok(state) => state
            .mig_devices()
            .into_iter()
            .map(|d| (d.uuid, (d.gi_profile_id, d.placement_start)))
            .collect(),
        Err(error) => {
            tracing::debug!(gpu = %g.uuid, %error, "the simulated GPU's MIG devices cannot be placed");
            BTreeMap::new()
        }
    }
}

/// The GPM figures DCGM gives per GPU and per GPU instance, as ratios.
fn gpm_values(g: &simnode::readings::Gpm) -> Vec<(gpu_model::fields::Field, f64)> {
    use gpu_model::fields::Field as F;
    vec![
        (F::ProfGrEngineActive, g.graphics_util_pct / 100.0),
        (F::ProfPipeTensorActive, g.tensor_util_pct / 100.0),
        (F::ProfDramActive, g.dram_bw_util_pct / 100.0),
        (F::ProfSmActive, g.sm_util_pct / 100.0),
        (F::ProfSmOccupancy, g.sm_occupancy_pct / 100.0),
        (F::ProfPipeFp64Active, g.fp64_util_pct / 100.0),
        (F::ProfPipeFp32Active, g.fp32_util_pct / 100.0),
        (F::ProfPipeFp16Active, g.fp16_util_pct / 100.0),
    ]
}

/// Samples the description's readings (`simnode::readings`), timed from the
/// sampler's start.
#[derive(Debug)]
struct SimSampler {
    node: NodeDescription,
    started: std::time::Instant,
}

impl super::Sampler for SimSampler {
    fn sample(
        &mut self,
        want: &gpu_model::fields::FieldSet,
    ) -> Result<super::Sample, BackendError> {
        use gpu_model::fields::Field as F;
        let secs = self.started.elapsed().as_secs_f64();
        let gpus = self
            .node
            .gpus
            .iter()
            .enumerate()
            .map(|(i, g)| {
                let r = g.readings(secs);
                let mut v: Vec<(F, Option<f64>)> = vec![
                    (F::SmClock, Some(r.sm_clock_mhz.into())),
                    (F::MemClock, Some(r.mem_clock_mhz.into())),
                    (F::GpuTemp, r.gpu_temp_c.map(f64::from)),
                    (F::MemoryTemp, r.mem_temp_c.map(f64::from)),
                    (F::PowerUsage, r.power_mw.map(|mw| f64::from(mw) / 1000.0)),
                    (F::TotalEnergyConsumption, r.energy_mj.map(|e| e as f64)),
                    (F::PcieReplayCounter, Some(r.pcie_replays as f64)),
                    (F::GpuUtil, r.gpu_util.map(f64::from)),
                    (F::MemCopyUtil, r.mem_util.map(f64::from)),
                    (F::EncUtil, Some(r.enc_util.into())),
                    (F::DecUtil, Some(r.dec_util.into())),
                    (F::FbTotal, Some(r.fb_total_mib as f64)),
                    (F::FbReserved, Some(r.fb_reserved_mib as f64)),
                    (F::FbUsed, Some(r.fb_used_mib as f64)),
                    (
                        F::FbFree,
                        Some(
                            r.fb_total_mib
                                .saturating_sub(r.fb_used_mib + r.fb_reserved_mib)
                                as f64,
                        ),
                    ),
                    (
                        F::NvlinkBandwidthTotal,
                        r.nvlink_tx_kib
                            .zip(r.nvlink_rx_kib)
                            .map(|(t, x)| (t + x) as f64),
                    ),
                    (F::CorrectableRemappedRows, Some(0.0)),
                    (F::UncorrectableRemappedRows, Some(0.0)),
                    (F::RowRemapFailure, Some(0.0)),
                    (F::EccSbeVolTotal, Some(r.ecc.sbe_volatile as f64)),
                    (F::EccDbeVolTotal, Some(r.ecc.dbe_volatile as f64)),
                    (F::EccSbeAggTotal, Some(r.ecc.sbe_aggregate as f64)),
                    (F::EccDbeAggTotal, Some(r.ecc.dbe_aggregate as f64)),
                    (F::RetiredSbe, r.retired.map(|p| p.sbe as f64)),
                    (F::RetiredDbe, r.retired.map(|p| p.dbe as f64)),
                    (F::RetiredPending, r.retired.map(|_| 0.0)),
                    (
                        F::NvlinkCrcFlitErrorCountTotal,
                        r.nvlink_errors.map(|e| e.crc_flit as f64),
                    ),
                    (
                        F::NvlinkCrcDataErrorCountTotal,
                        r.nvlink_errors.map(|e| e.crc_data as f64),
                    ),
                    (
                        F::NvlinkReplayErrorCountTotal,
                        r.nvlink_errors.map(|e| e.replay as f64),
                    ),
                    (
                        F::NvlinkRecoveryErrorCountTotal,
                        r.nvlink_errors.map(|e| e.recovery as f64),
                    ),
                    (
                        F::NvlinkBandwidthL0,
                        r.nvlink_link_kib.map(|k| 2.0 * k as f64),
                    ),
                    (F::PowerViolation, Some(r.throttle_ns.power as f64)),
                    (F::ThermalViolation, Some(r.throttle_ns.thermal as f64)),
                    (F::SyncBoostViolation, Some(r.throttle_ns.sync_boost as f64)),
                    (
                        F::BoardLimitViolation,
                        Some(r.throttle_ns.board_limit as f64),
                    ),
                    (F::LowUtilViolation, Some(r.throttle_ns.low_util as f64)),
                    (
                        F::ReliabilityViolation,
                        Some(r.throttle_ns.reliability as f64),
                    ),
                    (F::VgpuLicenseStatus, Some(r.vgpu_license.into())),
                ];
                if let Some(gpm) = r.gpm {
                    v.extend(gpm_values(&gpm).into_iter().map(|(f, x)| (f, Some(x))));
                    v.extend([
                        (
                            F::ProfPcieTxBytes,
                            Some(gpm.pcie_tx_mib_s * 1024.0 * 1024.0),
                        ),
                        (
                            F::ProfPcieRxBytes,
                            Some(gpm.pcie_rx_mib_s * 1024.0 * 1024.0),
                        ),
                    ]);
                }
                let b = g.board();
                let labels: Vec<(F, String)> = [
                    (F::NvmlVersion, self.node.nvml_version()),
                    (F::Brand, Some(super::dcgm_brand(b.brand).to_string())),
                    (F::Serial, Some(b.serial)),
                    (F::OemInforomVer, Some(b.inforom_oem)),
                    (F::EccInforomVer, Some(b.inforom_ecc)),
                    (F::PowerInforomVer, b.inforom_power),
                    (F::InforomImageVer, Some(b.inforom_image)),
                    (F::VbiosVersion, Some(b.vbios)),
                ]
                .into_iter()
                .filter_map(|(f, x)| x.filter(|_| want.wants(f)).map(|x| (f, x)))
                .collect();
                let mig = if g.mig.enabled {
                    g.mig
                        .devices
                        .iter()
                        .enumerate()
                        .map(|(k, m)| super::MigSample {
                            uuid: m.uuid.clone(),
                            gpu_instance_id: Some(m.gi_id(k)),
                            profile: m.profile.clone().unwrap_or_else(|| {
                                mig_profile_name(
                                    m.gi_slices,
                                    m.ci_slices(),
                                    m.memory_mib,
                                    g.memory_mib,
                                )
                            }),
                            values: [
                                (F::FbFree, m.memory_mib as f64),
                                (F::FbUsed, 0.0),
                                (F::FbTotal, m.memory_mib as f64),
                            ]
                            .into_iter()
                            .chain(
                                g.instance_gpm(m.gi_id(k))
                                    .map(|x| gpm_values(&x))
                                    .unwrap_or_default(),
                            )
                            .filter(|(f, _)| want.wants(*f))
                            .collect(),
                        })
                        .collect()
                } else {
                    Vec::new()
                };
                super::GpuSample {
                    index: i as u32,
                    uuid: g.uuid.clone(),
                    values: v
                        .into_iter()
                        .filter_map(|(f, x)| x.filter(|_| want.wants(f)).map(|x| (f, x)))
                        .collect(),
                    labels,
                    mig,
                }
            })
            .collect();
        Ok(super::Sample { gpus })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Each MIG device's (profile, GPU-instance profile ID, placement start).
    fn placed(g: &BackendGpu) -> Vec<(&str, Option<u32>, Option<u32>)> {
        g.mig_devices
            .iter()
            .map(|m| (m.profile.as_str(), m.gi_profile_id, m.placement_start))
            .collect()
    }

    #[test]
    fn mig_devices_carry_their_gi_profile_id_and_placement() {
        let b = SimulatedBackend::new(simnode::NodeDescription::load("h100-mig-2").unwrap());
        let snap = b.snapshot().unwrap();
        // The H100 80GB's profile IDs as `nvidia-smi mig -lgip` lists them
        // (3g.40gb 9, 2g.20gb 14, 1g.10gb 19); the 3g is placed at 4..8,
        // the 2g at 0..2, the 1g's in the slices left (2 and 3).
        assert_eq!(
            placed(&snap.gpus[0]),
            [
                ("3g.40gb", Some(9), Some(4)),
                ("2g.20gb", Some(14), Some(0)),
                ("1g.10gb", Some(19), Some(2)),
                ("1g.10gb", Some(19), Some(3)),
            ]
        );
        // Seven 1g.10gb, in GPU-instance ID order, placed in the order the
        // driver fills an empty H100 with them: 6, 4, 5, 0, 1, 2, 3.
        assert_eq!(
            placed(&snap.gpus[1]),
            [6, 4, 5, 0, 1, 2, 3].map(|s| ("1g.10gb", Some(19), Some(s)))
        );
        // A GPU without MIG has no devices to place.
        let full = SimulatedBackend::new(simnode::NodeDescription::load("h100-sxm-8").unwrap());
        assert!(full.snapshot().unwrap().gpus[0].mig_devices.is_empty());
    }

    #[test]
    fn mig_devices_that_cannot_be_placed_keep_the_rest_of_their_facts() {
        let mut node = simnode::NodeDescription::load("h100-mig-2").unwrap();
        // Eight 1g.10gb do not fit on a GPU with seven compute slices.
        let extra = node.gpus[1].mig.devices[0].clone();
        node.gpus[1].mig.devices.push(simnode::MigDeviceDesc {
            uuid: "MIG-0c1d2e3f-4a5b-5c6d-8e7f-90a1b2c3d411".into(),
            ..extra
        });
        let snap = SimulatedBackend::new(node).snapshot().unwrap();
        let migs = &snap.gpus[1].mig_devices;
        assert_eq!(migs.len(), 8);
        assert!(
            migs.iter()
                .all(|m| m.gi_profile_id.is_none() && m.placement_start.is_none())
        );
        assert_eq!(migs[7].profile, "1g.10gb");
        assert_eq!(migs[7].gpu_instance_id, Some(7));
        // The other GPU is untouched.
        assert_eq!(placed(&snap.gpus[0])[0], ("3g.40gb", Some(9), Some(4)));
    }

    #[test]
    fn compute_modes_are_kept_per_gpu() {
        let b = SimulatedBackend::new(simnode::NodeDescription::load("t4-4").unwrap());
        let uuid = b.node().gpus[1].uuid.clone();
        assert_eq!(b.compute_mode(&uuid).unwrap(), ComputeMode::Default);
        b.set_compute_mode(&uuid, ComputeMode::ExclusiveProcess)
            .unwrap();
        assert_eq!(
            b.compute_mode(&uuid).unwrap(),
            ComputeMode::ExclusiveProcess
        );
        let first = b.node().gpus[0].uuid.clone();
        assert_eq!(b.compute_mode(&first).unwrap(), ComputeMode::Default);
        assert!(
            b.set_compute_mode("GPU-nope", ComputeMode::Default)
                .is_err()
        );
    }
}
