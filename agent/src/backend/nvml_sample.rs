//! Sampling the exported fields through NVML: one pass over every GPU, only
//! the calls the field set needs. The DCGM profiling fields come from GPM
//! (Hopper and newer): two samples a pass apart, so the previous pass's GPM
//! sample is kept per GPU.

use std::collections::BTreeMap;
use std::sync::Arc;

use nvml_wrapper::Nvml;
use nvml_wrapper::enum_wrappers::device::{Clock, TemperatureSensor};
use nvml_wrapper::enums::gpm::GpmMetricId;
use nvml_wrapper::error::NvmlError;
use nvml_wrapper::gpm::{GpmSample, gpm_metrics_get};
use nvml_wrapper::structs::device::FieldId;
use nvml_wrapper_sys::bindings::field_id::{
    NVML_FI_DEV_MEMORY_TEMP, NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_RX,
    NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_TX,
};
use nvml_wrapper_sys::bindings::nvmlGpmSample_t;

use super::nvml::{NvmlBackend, optional, reading, remapped_rows};
use super::{BackendError, GpuSample, MigSample, Sample, Sampler, mig_profile_name};
use crate::metrics::fields::{Field, FieldSet};

const MIB: f64 = 1024.0 * 1024.0;

/// Whole MiB, as DCGM reports framebuffer sizes (dcgm-exporter's
/// `DCGM_FI_DEV_FB_*` are integers: the bytes divided down, the rest dropped).
fn whole_mib(bytes: u64) -> f64 {
    (bytes / (1024 * 1024)) as f64
}

/// GPM metrics behind the DCGM profiling fields, and how to scale them.
const GPM: &[(Field, GpmMetricId, f64)] = &[
    (Field::ProfGrEngineActive, GpmMetricId::GraphicsUtil, 0.01),
    (
        Field::ProfPipeTensorActive,
        GpmMetricId::AnyTensorUtil,
        0.01,
    ),
    (Field::ProfDramActive, GpmMetricId::DramBwUtil, 0.01),
    (Field::ProfPcieTxBytes, GpmMetricId::PcieTxPerSec, MIB),
    (Field::ProfPcieRxBytes, GpmMetricId::PcieRxPerSec, MIB),
];

/// A GPM sample kept between passes (owned: freed on drop).
struct KeptGpm {
    raw: nvmlGpmSample_t,
}

// SAFETY: a GPM sample is plain memory NVML allocated; it is used by one
// thread at a time (the sampler is `Send`, not `Sync`).
#[allow(unsafe_code)]
unsafe impl Send for KeptGpm {}

pub(super) struct NvmlSampler {
    nvml: Arc<Nvml>,
    /// Each GPU's previous GPM sample, by UUID.
    gpm: BTreeMap<String, KeptGpm>,
    /// GPUs without GPM (asked once).
    no_gpm: std::collections::BTreeSet<String>,
}

/// Takes a kept GPM sample back (freed when the result drops).
#[allow(unsafe_code)]
fn take_gpm<'n>(
    nvml: &'n Nvml,
    kept: &mut BTreeMap<String, KeptGpm>,
    uuid: &str,
) -> Option<GpmSample<'n>> {
    let k = kept.remove(uuid)?;
    // SAFETY: the handle came from `GpmSample::into_handle` on this same NVML
    // session and was owned by `k` alone; ownership moves back.
    Some(unsafe { GpmSample::from_handle(nvml, k.raw) })
}

impl Drop for NvmlSampler {
    fn drop(&mut self) {
        let nvml = self.nvml.clone();
        let uuids: Vec<String> = self.gpm.keys().cloned().collect();
        for u in uuids {
            drop(take_gpm(&nvml, &mut self.gpm, &u));
        }
    }
}

impl std::fmt::Debug for NvmlSampler {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("NvmlSampler").finish_non_exhaustive()
    }
}

impl NvmlBackend {
    pub(super) fn nvml_sampler(&self) -> NvmlSampler {
        NvmlSampler {
            nvml: self.nvml.clone(),
            gpm: BTreeMap::new(),
            no_gpm: Default::default(),
        }
    }
}

impl Sampler for NvmlSampler {
    fn sample(&mut self, want: &FieldSet) -> Result<Sample, BackendError> {
        let nvml = self.nvml.clone();
        let count = nvml.device_count().map_err(|source| BackendError::Nvml {
            call: "nvmlDeviceGetCount",
            source,
        })?;
        let mut gpus = Vec::with_capacity(count as usize);
        for index in 0..count {
            match self.sample_gpu(&nvml, index, want) {
                Ok(g) => gpus.push(g),
                // A lost GPU: the others are still sampled; health says why.
                Err(NvmlError::GpuLost) => {}
                Err(source) => {
                    return Err(BackendError::Device {
                        index,
                        call: "sampling",
                        source,
                    });
                }
            }
        }
        Ok(Sample { gpus })
    }
}

impl NvmlSampler {
    fn sample_gpu(
        &mut self,
        nvml: &Nvml,
        index: u32,
        want: &FieldSet,
    ) -> Result<GpuSample, NvmlError> {
        let d = nvml.device_by_index(index)?;
        let uuid = d.uuid()?;
        let mut v: Vec<(Field, f64)> = Vec::with_capacity(24);
        let mut put = |f: Field, x: Option<f64>| {
            if let Some(x) = x {
                v.push((f, x));
            }
        };
        if want.wants(Field::SmClock) {
            put(
                Field::SmClock,
                reading(index, "SM clock", d.clock_info(Clock::SM)).map(f64::from),
            );
        }
        if want.wants(Field::MemClock) {
            put(
                Field::MemClock,
                reading(index, "memory clock", d.clock_info(Clock::Memory)).map(f64::from),
            );
        }
        if want.wants(Field::GpuTemp) {
            put(
                Field::GpuTemp,
                reading(index, "temperature", d.temperature(TemperatureSensor::Gpu)).map(f64::from),
            );
        }
        if want.wants(Field::PowerUsage) {
            put(
                Field::PowerUsage,
                reading(index, "power", d.power_usage()).map(|mw| f64::from(mw) / 1000.0),
            );
        }
        if want.wants(Field::TotalEnergyConsumption) {
            put(
                Field::TotalEnergyConsumption,
                reading(index, "energy", d.total_energy_consumption()).map(|mj| mj as f64),
            );
        }
        if want.wants(Field::PcieReplayCounter) {
            put(
                Field::PcieReplayCounter,
                reading(index, "PCIe replays", d.pcie_replay_counter()).map(f64::from),
            );
        }
        if (want.wants(Field::GpuUtil) || want.wants(Field::MemCopyUtil))
            && let Some(u) = reading(index, "utilization", d.utilization_rates())
        {
            put(Field::GpuUtil, Some(f64::from(u.gpu)));
            put(Field::MemCopyUtil, Some(f64::from(u.memory)));
        }
        if want.wants(Field::EncUtil) {
            put(
                Field::EncUtil,
                reading(index, "encoder", d.encoder_utilization())
                    .map(|u| f64::from(u.utilization)),
            );
        }
        if want.wants(Field::DecUtil) {
            put(
                Field::DecUtil,
                reading(index, "decoder", d.decoder_utilization())
                    .map(|u| f64::from(u.utilization)),
            );
        }
        let fb = [
            Field::FbFree,
            Field::FbUsed,
            Field::FbReserved,
            Field::FbTotal,
        ];
        if fb.iter().any(|f| want.wants(*f))
            && let Some(m) = reading(index, "memory", d.memory_info())
        {
            put(Field::FbFree, Some(whole_mib(m.free)));
            put(Field::FbUsed, Some(whole_mib(m.used)));
            put(Field::FbReserved, Some(whole_mib(m.reserved)));
            put(Field::FbTotal, Some(whole_mib(m.total)));
        }
        if want.wants(Field::MemoryTemp) || want.wants(Field::NvlinkBandwidthTotal) {
            let ids = [
                FieldId(NVML_FI_DEV_MEMORY_TEMP),
                FieldId(NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_TX),
                FieldId(NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_RX),
            ];
            if let Some(values) = reading(index, "field values", d.field_values_for(&ids)) {
                let num = |i: usize| -> Option<f64> {
                    use nvml_wrapper::enums::device::SampleValue as S;
                    match values.get(i)?.as_ref().ok()?.value.as_ref().ok()? {
                        S::F64(x) => Some(*x),
                        S::U32(x) => Some(f64::from(*x)),
                        S::U64(x) => Some(*x as f64),
                        S::I64(x) => Some(*x as f64),
                    }
                };
                put(Field::MemoryTemp, num(0));
                if let (Some(tx), Some(rx)) = (num(1), num(2)) {
                    put(Field::NvlinkBandwidthTotal, Some(tx + rx));
                }
            }
        }
        let remap = [
            Field::CorrectableRemappedRows,
            Field::UncorrectableRemappedRows,
            Field::RowRemapFailure,
        ];
        if remap.iter().any(|f| want.wants(*f))
            && let Some(r) = remapped_rows(&nvml.lib().nvmlDeviceGetRemappedRows, &d)
        {
            put(
                Field::CorrectableRemappedRows,
                Some(f64::from(r.correctable)),
            );
            put(
                Field::UncorrectableRemappedRows,
                Some(f64::from(r.uncorrectable)),
            );
            put(Field::RowRemapFailure, Some(f64::from(u8::from(r.failure))));
        }
        if GPM.iter().any(|(f, _, _)| want.wants(*f)) && !self.no_gpm.contains(&uuid) {
            match d.gpm_support() {
                Ok(true) => {
                    let cur = d.gpm_sample()?;
                    if let Some(prev) = take_gpm(nvml, &mut self.gpm, &uuid) {
                        let ids: Vec<GpmMetricId> = GPM.iter().map(|(_, id, _)| *id).collect();
                        let got = gpm_metrics_get(nvml, &prev, &cur, &ids);
                        drop(prev);
                        match got {
                            Ok(results) => {
                                for ((f, _, scale), r) in GPM.iter().zip(results) {
                                    if let Ok(r) = r {
                                        v.push((*f, r.value * scale));
                                    }
                                }
                            }
                            Err(e) => {
                                tracing::warn!(gpu = index, error = %e, "NVML GPM metrics failed")
                            }
                        }
                    }
                    self.gpm.insert(
                        uuid.clone(),
                        KeptGpm {
                            raw: cur.into_handle(),
                        },
                    );
                }
                Ok(false) | Err(NvmlError::NotSupported | NvmlError::FailedToLoadSymbol(_)) => {
                    self.no_gpm.insert(uuid.clone());
                }
                Err(e) => return Err(e),
            }
        }
        let mut mig = Vec::new();
        let mig_fb = [Field::FbFree, Field::FbUsed, Field::FbTotal];
        if mig_fb.iter().any(|f| want.wants(*f))
            && optional(d.mig_mode())?.is_some_and(|m| m.current == 1)
        {
            let total = optional(d.memory_info())?.map_or(0, |m| m.total / (1024 * 1024));
            for slot in 0..d.mig_device_count()? {
                let m = match d.mig_device_by_index(slot) {
                    Ok(m) => m,
                    Err(NvmlError::NotFound) => continue,
                    Err(e) => return Err(e),
                };
                let a = m.attributes()?;
                let mut values = Vec::new();
                if let Some(mem) = reading(index, "MIG memory", m.memory_info()) {
                    values.push((Field::FbFree, whole_mib(mem.free)));
                    values.push((Field::FbUsed, whole_mib(mem.used)));
                    values.push((Field::FbTotal, whole_mib(mem.total)));
                }
                mig.push(MigSample {
                    uuid: m.uuid()?,
                    gpu_instance_id: super::nvml::instance_id(
                        &nvml.lib().nvmlDeviceGetGpuInstanceId,
                        &m,
                    ),
                    profile: mig_profile_name(
                        a.gpu_instance_slice_count,
                        a.compute_instance_slice_count,
                        a.memory_size_mb,
                        total,
                    ),
                    values,
                });
            }
        }
        v.retain(|(f, _)| want.wants(*f));
        Ok(GpuSample {
            index,
            uuid,
            values: v,
            mig,
        })
    }
}

#[cfg(test)]
mod mib_tests {
    /// The real H100 showed 1138.8125 MiB used; dcgm-exporter says 1138.
    #[test]
    fn framebuffer_sizes_are_whole_mib() {
        assert_eq!(super::whole_mib(1_194_131_456), 1138.0);
        assert_eq!(super::whole_mib(1024 * 1024 - 1), 0.0);
        assert_eq!(super::whole_mib(81559 * 1024 * 1024), 81559.0);
    }
}
