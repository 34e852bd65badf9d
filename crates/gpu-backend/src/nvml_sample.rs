//! Sampling the exported fields through NVML: one pass over every GPU, only
//! the calls the field set needs. The DCGM profiling fields come from GPM
//! (Hopper and newer): two samples a pass apart, so the previous pass's GPM
//! sample is kept per GPU and per MIG device (a GPU instance's own sample,
//! `nvmlGpmMigSampleGet`).
//!
//! What each call costs on a real H100 (tests/fake-nvml/costs/h100-pcie-vm.txt,
//! p50), where that table measured it, is noted beside the call; the fake
//! libnvidia-ml charges the same (and, for the calls the table lacks, what
//! tests/fake-nvml/costs/modelled.txt says).

use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;
use std::time::{Duration, Instant};

use nvml_wrapper::Nvml;
use nvml_wrapper::enum_wrappers::device::{Clock, InfoRom, TemperatureSensor};
use nvml_wrapper::enums::gpm::GpmMetricId;
use nvml_wrapper::error::NvmlError;
use nvml_wrapper::gpm::{GpmSample, gpm_metrics_get};
use nvml_wrapper_sys::bindings::field_id as fi;
use nvml_wrapper_sys::bindings::{nvmlFieldValue_t, nvmlGpmSample_t};

use super::nvml::{NvmlBackend, optional, reading, remapped_rows};
use super::{BackendError, GpuSample, MigSample, Sample, Sampler, mig_profile_name};
use gpu_model::fields::{Field, FieldSet};

const MIB: f64 = 1024.0 * 1024.0;

/// Whole MiB, as DCGM reports framebuffer sizes (dcgm-exporter's
/// `DCGM_FI_DEV_FB_*` are integers: the bytes divided down, the rest dropped).
fn whole_mib(bytes: u64) -> f64 {
    (bytes / (1024 * 1024)) as f64
}

/// GPM metrics behind the DCGM profiling fields (DCGM's own mapping,
/// `DcgmFieldIdToNvmlGpmMetricId`), how to scale them (percentages become
/// ratios, MiB/s bytes/s), and whether DCGM gives them per GPU instance
/// (its field's entity level is GPU_I or GPU_CI; PCIe traffic is the
/// GPU's only).
const GPM: &[(Field, GpmMetricId, f64, bool)] = &[
    (
        Field::ProfGrEngineActive,
        GpmMetricId::GraphicsUtil,
        0.01,
        true,
    ),
    (Field::ProfSmActive, GpmMetricId::SmUtil, 0.01, true),
    (Field::ProfSmOccupancy, GpmMetricId::SmOccupancy, 0.01, true),
    (
        Field::ProfPipeTensorActive,
        GpmMetricId::AnyTensorUtil,
        0.01,
        true,
    ),
    (Field::ProfDramActive, GpmMetricId::DramBwUtil, 0.01, true),
    (Field::ProfPipeFp64Active, GpmMetricId::Fp64Util, 0.01, true),
    (Field::ProfPipeFp32Active, GpmMetricId::Fp32Util, 0.01, true),
    (Field::ProfPipeFp16Active, GpmMetricId::Fp16Util, 0.01, true),
    (
        Field::ProfPcieTxBytes,
        GpmMetricId::PcieTxPerSec,
        MIB,
        false,
    ),
    (
        Field::ProfPcieRxBytes,
        GpmMetricId::PcieRxPerSec,
        MIB,
        false,
    ),
];

/// `scopeId` for "every link" (NVML: a scope of UINT_MAX sums the NVLink
/// throughput counters over all links; 0 is link 0 alone).
const ALL_LINKS: u32 = u32::MAX;

/// NVML field values behind DCGM fields, read together in one
/// `nvmlDeviceGetFieldValues` (DCGM reads these fields through the same
/// call: dcgm_fields.cpp names each one's NVML field): the DCGM field, the
/// NVML field and its scope. A field listed twice is the sum (NVLink data
/// sent plus received, as DCGM adds them). Values come in the DCGM field's
/// unit: ECC and page counts, NVLink KiB, clock-throttle ns.
const FIELD_VALUES: &[(Field, u32, u32)] = &[
    (Field::MemoryTemp, fi::NVML_FI_DEV_MEMORY_TEMP, 0),
    (
        Field::NvlinkBandwidthTotal,
        fi::NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_TX,
        ALL_LINKS,
    ),
    (
        Field::NvlinkBandwidthTotal,
        fi::NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_RX,
        ALL_LINKS,
    ),
    (
        Field::NvlinkBandwidthL0,
        fi::NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_TX,
        0,
    ),
    (
        Field::NvlinkBandwidthL0,
        fi::NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_RX,
        0,
    ),
    (Field::EccSbeVolTotal, fi::NVML_FI_DEV_ECC_SBE_VOL_TOTAL, 0),
    (Field::EccDbeVolTotal, fi::NVML_FI_DEV_ECC_DBE_VOL_TOTAL, 0),
    (Field::EccSbeAggTotal, fi::NVML_FI_DEV_ECC_SBE_AGG_TOTAL, 0),
    (Field::EccDbeAggTotal, fi::NVML_FI_DEV_ECC_DBE_AGG_TOTAL, 0),
    (Field::RetiredSbe, fi::NVML_FI_DEV_RETIRED_SBE, 0),
    (Field::RetiredDbe, fi::NVML_FI_DEV_RETIRED_DBE, 0),
    (Field::RetiredPending, fi::NVML_FI_DEV_RETIRED_PENDING, 0),
    (
        Field::NvlinkCrcFlitErrorCountTotal,
        fi::NVML_FI_DEV_NVLINK_CRC_FLIT_ERROR_COUNT_TOTAL,
        0,
    ),
    (
        Field::NvlinkCrcDataErrorCountTotal,
        fi::NVML_FI_DEV_NVLINK_CRC_DATA_ERROR_COUNT_TOTAL,
        0,
    ),
    (
        Field::NvlinkReplayErrorCountTotal,
        fi::NVML_FI_DEV_NVLINK_REPLAY_ERROR_COUNT_TOTAL,
        0,
    ),
    (
        Field::NvlinkRecoveryErrorCountTotal,
        fi::NVML_FI_DEV_NVLINK_RECOVERY_ERROR_COUNT_TOTAL,
        0,
    ),
    (Field::PowerViolation, fi::NVML_FI_DEV_PERF_POLICY_POWER, 0),
    (
        Field::ThermalViolation,
        fi::NVML_FI_DEV_PERF_POLICY_THERMAL,
        0,
    ),
    (
        Field::SyncBoostViolation,
        fi::NVML_FI_DEV_PERF_POLICY_SYNC_BOOST,
        0,
    ),
    (
        Field::BoardLimitViolation,
        fi::NVML_FI_DEV_PERF_POLICY_BOARD_LIMIT,
        0,
    ),
    (
        Field::LowUtilViolation,
        fi::NVML_FI_DEV_PERF_POLICY_LOW_UTILIZATION,
        0,
    ),
    (
        Field::ReliabilityViolation,
        fi::NVML_FI_DEV_PERF_POLICY_RELIABILITY,
        0,
    ),
];

/// The label fields read per GPU (the driver version comes with the
/// inventory).
const LABELS: &[Field] = &[
    Field::NvmlVersion,
    Field::Brand,
    Field::Serial,
    Field::OemInforomVer,
    Field::EccInforomVer,
    Field::PowerInforomVer,
    Field::InforomImageVer,
    Field::VbiosVersion,
];

/// How long a GPU's label values are kept before they are read again: they
/// are the board's facts (a VBIOS or InfoROM changes only with a flash and a
/// GPU reset), so they are not read every pass.
const LABELS_KEPT: Duration = Duration::from_secs(600);

/// A GPM sample kept between passes (owned: freed on drop).
struct KeptGpm {
    raw: nvmlGpmSample_t,
}

// SAFETY: a GPM sample is plain memory NVML allocated; it is used by one
// thread at a time (the sampler is `Send`, not `Sync`).
#[allow(unsafe_code)]
unsafe impl Send for KeptGpm {}

/// A GPU's label values and when they were read.
struct KeptLabels {
    at: Instant,
    labels: Vec<(Field, String)>,
}

pub(super) struct NvmlSampler {
    nvml: Arc<Nvml>,
    /// The previous GPM sample of each GPU and MIG device, by UUID.
    gpm: BTreeMap<String, KeptGpm>,
    /// GPUs and MIG devices without GPM (asked once).
    no_gpm: BTreeSet<String>,
    /// Each GPU's label values, by UUID.
    labels: BTreeMap<String, KeptLabels>,
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
            no_gpm: BTreeSet::new(),
            labels: BTreeMap::new(),
        }
    }
}

impl Sampler for NvmlSampler {
    fn sample(&mut self, want: &FieldSet) -> Result<Sample, BackendError> {
        let nvml = self.nvml.clone();
        let count = nvml.device_count().map_err(|source| BackendError::Nvml {
            call: "nvmlDeviceGetCount",
            source: source.into(),
        })?;
        let mut gpus = Vec::with_capacity(count as usize);
        let mut seen = BTreeSet::new();
        for index in 0..count {
            match self.sample_gpu(&nvml, index, want, &mut seen) {
                Ok(g) => gpus.push(g),
                // A lost GPU: the others are still sampled; health says why.
                Err(NvmlError::GpuLost) => {}
                Err(source) => {
                    return Err(BackendError::Device {
                        index,
                        call: "sampling",
                        source: source.into(),
                    });
                }
            }
        }
        // GPM samples of GPUs and MIG devices that are gone are freed.
        let gone: Vec<String> = self
            .gpm
            .keys()
            .filter(|u| !seen.contains(*u))
            .cloned()
            .collect();
        for u in gone {
            drop(take_gpm(&nvml, &mut self.gpm, &u));
        }
        self.labels.retain(|u, _| seen.contains(u));
        Ok(Sample { gpus })
    }
}

/// One `nvmlDeviceGetFieldValues` call for `(field id, scope)` pairs: each
/// value as a number, `None` where NVML did not give it (a field the GPU
/// lacks: NVLink counters on a PCIe card, retired pages from Ampere on).
/// nvml-wrapper's `field_values_for` leaves every scope 0, which for the
/// NVLink throughput counters is link 0 alone; DCGM asks UINT_MAX for its
/// totals. The IDs asked here are below 251, which NVML 13's renumbering
/// leaves alone.
#[allow(unsafe_code)]
fn field_values(
    nvml: &Nvml,
    device: &nvml_wrapper::Device<'_>,
    ids: &[(u32, u32)],
) -> Result<Vec<Option<f64>>, NvmlError> {
    let sym = nvml_wrapper::error::nvml_sym(nvml.lib().nvmlDeviceGetFieldValues.as_ref())?;
    let mut values: Vec<nvmlFieldValue_t> = ids
        .iter()
        .map(|&(id, scope)| {
            // SAFETY: nvmlFieldValue_t is plain C data; all-zero is valid.
            let mut v: nvmlFieldValue_t = unsafe { std::mem::zeroed() };
            v.fieldId = id;
            v.scopeId = scope;
            v
        })
        .collect();
    // SAFETY: the handle belongs to `device`, which borrows the live NVML
    // session `sym` was loaded from; `values` holds `ids.len()` entries.
    let rc = unsafe { sym(device.handle(), values.len() as i32, values.as_mut_ptr()) };
    nvml_wrapper::error::nvml_try(rc)?;
    Ok(values
        .iter()
        .map(|v| {
            if v.nvmlReturn != nvml_wrapper_sys::bindings::nvmlReturn_enum_NVML_SUCCESS {
                return None;
            }
            // SAFETY: NVML set `valueType` to the union member it wrote.
            Some(unsafe {
                match v.valueType {
                    0 => v.value.dVal,
                    1 => f64::from(v.value.uiVal),
                    2 => v.value.ulVal as f64,
                    3 => v.value.ullVal as f64,
                    4 => v.value.sllVal as f64,
                    5 => f64::from(v.value.siVal),
                    6 => f64::from(v.value.usVal),
                    _ => return None,
                }
            })
        })
        .collect())
}

/// DCGM's vGPU licence status (`nvmlDeviceGetGridLicensableFeatures_v4`, as
/// DCGM's cache manager reads it): 0 where the GPU takes no GRID licence
/// (bare metal), else 1 when its vGPU feature is licensed. `None` where NVML
/// does not answer. Not in the real-H100 cost table (the fake charges the
/// table's median, 2.75 µs).
#[allow(unsafe_code)]
fn vgpu_license(nvml: &Nvml, device: &nvml_wrapper::Device<'_>) -> Result<Option<f64>, NvmlError> {
    use nvml_wrapper_sys::bindings::{
        nvmlGridLicensableFeatures_t,
        nvmlGridLicenseFeatureCode_t_NVML_GRID_LICENSE_FEATURE_CODE_VGPU as VGPU,
    };
    // A library without it (before the v4 struct) is as a GPU that does not
    // say: no series, and no warning every pass.
    let sym = match nvml_wrapper::error::nvml_sym(
        nvml.lib().nvmlDeviceGetGridLicensableFeatures_v4.as_ref(),
    ) {
        Ok(sym) => sym,
        Err(NvmlError::FailedToLoadSymbol(_)) => return Ok(None),
        Err(e) => return Err(e),
    };
    // SAFETY: plain C data; all-zero is valid.
    let mut f: nvmlGridLicensableFeatures_t = unsafe { std::mem::zeroed() };
    // SAFETY: the handle belongs to `device` (live session); `f` is a valid
    // out-pointer for the call.
    let rc = unsafe { sym(device.handle(), &mut f) };
    if optional(nvml_wrapper::error::nvml_try(rc))?.is_none() {
        return Ok(None);
    }
    if f.isGridLicenseSupported == 0 {
        return Ok(Some(0.0));
    }
    let n = (f.licensableFeaturesCount as usize).min(f.gridLicensableFeatures.len());
    Ok(f.gridLicensableFeatures[..n]
        .iter()
        .find(|x| x.featureCode == VGPU)
        .map(|x| f64::from(u8::from(x.featureState > 0))))
}

/// A GPU's label values: NVML's version and the board's facts. Costs on
/// the real H100: brand 1.7 µs, serial 3.4 µs, VBIOS 2.9 µs; the InfoROM
/// versions and NVML's version were not measured (modelled on the VBIOS
/// version and the driver version: 2.9 µs and 1.8 µs). Read once per
/// [`LABELS_KEPT`].
fn read_labels(nvml: &Nvml, index: u32, d: &nvml_wrapper::Device<'_>) -> Vec<(Field, String)> {
    let mut out = Vec::with_capacity(LABELS.len());
    let mut put = |f: Field, v: Option<String>| {
        if let Some(v) = v.filter(|v| !v.is_empty()) {
            out.push((f, v));
        }
    };
    put(
        Field::NvmlVersion,
        reading(index, "NVML version", nvml.sys_nvml_version()),
    );
    put(
        Field::Brand,
        reading(index, "brand", d.brand()).map(|b| super::dcgm_brand(b.as_c()).to_string()),
    );
    put(Field::Serial, reading(index, "serial", d.serial()));
    put(
        Field::OemInforomVer,
        reading(index, "OEM InfoROM", d.info_rom_version(InfoRom::OEM)),
    );
    put(
        Field::EccInforomVer,
        reading(index, "ECC InfoROM", d.info_rom_version(InfoRom::ECC)),
    );
    put(
        Field::PowerInforomVer,
        reading(index, "power InfoROM", d.info_rom_version(InfoRom::Power)),
    );
    put(
        Field::InforomImageVer,
        reading(index, "InfoROM image", d.info_rom_image_version()),
    );
    put(
        Field::VbiosVersion,
        reading(index, "VBIOS", d.vbios_version()),
    );
    out
}

/// GPM figures between the kept sample of `key` and `cur`, for the metrics
/// of `metrics` the field set wants; `cur` is kept for the next pass. Costs
/// on the real H100: a sample (alloc, get, free) 54.9 µs; the metrics
/// computation was not measured (the fake charges the table's median).
fn gpm_between(
    nvml: &Nvml,
    kept: &mut BTreeMap<String, KeptGpm>,
    key: &str,
    cur: GpmSample<'_>,
    metrics: &[&(Field, GpmMetricId, f64, bool)],
    index: u32,
    out: &mut Vec<(Field, f64)>,
) {
    if let Some(prev) = take_gpm(nvml, kept, key) {
        let ids: Vec<GpmMetricId> = metrics.iter().map(|(_, id, _, _)| *id).collect();
        match gpm_metrics_get(nvml, &prev, &cur, &ids) {
            Ok(results) => {
                for ((f, _, scale, _), r) in metrics.iter().zip(results) {
                    if let Ok(r) = r
                        && r.value.is_finite()
                    {
                        out.push((*f, r.value * scale));
                    }
                }
            }
            Err(e) => {
                tracing::warn!(gpu = index, device = key, error = %e, "NVML GPM metrics failed")
            }
        }
    }
    kept.insert(
        key.to_string(),
        KeptGpm {
            raw: cur.into_handle(),
        },
    );
}

impl NvmlSampler {
    fn sample_gpu(
        &mut self,
        nvml: &Nvml,
        index: u32,
        want: &FieldSet,
        seen: &mut BTreeSet<String>,
    ) -> Result<GpuSample, NvmlError> {
        let d = nvml.device_by_index(index)?;
        let uuid = d.uuid()?;
        seen.insert(uuid.clone());
        let mut v: Vec<(Field, f64)> = Vec::with_capacity(24);
        let mut put = |f: Field, x: Option<f64>| {
            if let Some(x) = x {
                v.push((f, x));
            }
        };
        // Real H100: 2.3 µs.
        if want.wants(Field::SmClock) {
            put(
                Field::SmClock,
                reading(index, "SM clock", d.clock_info(Clock::SM)).map(f64::from),
            );
        }
        // Real H100: 2.1 µs.
        if want.wants(Field::MemClock) {
            put(
                Field::MemClock,
                reading(index, "memory clock", d.clock_info(Clock::Memory)).map(f64::from),
            );
        }
        // Real H100: 2.1 µs.
        if want.wants(Field::GpuTemp) {
            put(
                Field::GpuTemp,
                reading(index, "temperature", d.temperature(TemperatureSensor::Gpu)).map(f64::from),
            );
        }
        // Real H100: 1.9 µs.
        if want.wants(Field::PowerUsage) {
            put(
                Field::PowerUsage,
                reading(index, "power", d.power_usage()).map(|mw| f64::from(mw) / 1000.0),
            );
        }
        // Real H100: 3.18 ms, the dearest call of a pass.
        if want.wants(Field::TotalEnergyConsumption) {
            put(
                Field::TotalEnergyConsumption,
                reading(index, "energy", d.total_energy_consumption()).map(|mj| mj as f64),
            );
        }
        // Real H100: 173.4 µs.
        if want.wants(Field::PcieReplayCounter) {
            put(
                Field::PcieReplayCounter,
                reading(index, "PCIe replays", d.pcie_replay_counter()).map(f64::from),
            );
        }
        // Real H100: 1.6 µs.
        if (want.wants(Field::GpuUtil) || want.wants(Field::MemCopyUtil))
            && let Some(u) = reading(index, "utilization", d.utilization_rates())
        {
            put(Field::GpuUtil, Some(f64::from(u.gpu)));
            put(Field::MemCopyUtil, Some(f64::from(u.memory)));
        }
        // Real H100: 2.3 µs (encoder; the decoder was not measured).
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
        // Real H100: 7.8 µs (v1; v2 not measured).
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
        // One call for every field-value field wanted. Not measured on the
        // real H100 as such; the fake charges each field what the call that
        // gives the same figure cost there (clock-throttle time as
        // nvmlDeviceGetViolationStatus, 741 µs each; ECC counts as
        // nvmlDeviceGetTotalEccErrors, 2.6 µs; memory temperature as
        // nvmlDeviceGetTemperature, 2.1 µs; ...), see the fake's costs.
        let asked: Vec<&(Field, u32, u32)> = FIELD_VALUES
            .iter()
            .filter(|(f, _, _)| want.wants(*f))
            .collect();
        if !asked.is_empty() {
            let ids: Vec<(u32, u32)> = asked.iter().map(|(_, id, scope)| (*id, *scope)).collect();
            if let Some(values) = reading(index, "field values", field_values(nvml, &d, &ids)) {
                let mut sums: BTreeMap<Field, Option<f64>> = BTreeMap::new();
                for ((f, _, _), x) in asked.iter().zip(values) {
                    // A field of two values (tx + rx) needs both.
                    let s = sums.entry(*f).or_insert(Some(0.0));
                    *s = s.zip(x).map(|(a, b)| a + b);
                }
                for (f, x) in sums {
                    put(f, x);
                }
            }
        }
        // Real H100: 2.4 µs.
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
        if want.wants(Field::VgpuLicenseStatus) {
            put(
                Field::VgpuLicenseStatus,
                reading(index, "vGPU licence", vgpu_license(nvml, &d)).flatten(),
            );
        }
        let gpm: Vec<&(Field, GpmMetricId, f64, bool)> =
            GPM.iter().filter(|(f, ..)| want.wants(*f)).collect();
        let mut has_gpm = false;
        if !gpm.is_empty() && !self.no_gpm.contains(&uuid) {
            match d.gpm_support() {
                Ok(true) => {
                    has_gpm = true;
                    let cur = d.gpm_sample()?;
                    gpm_between(nvml, &mut self.gpm, &uuid, cur, &gpm, index, &mut v);
                }
                Ok(false) | Err(NvmlError::NotSupported | NvmlError::FailedToLoadSymbol(_)) => {
                    self.no_gpm.insert(uuid.clone());
                }
                Err(e) => return Err(e),
            }
        }
        let labels = if LABELS.iter().any(|f| want.wants(*f)) {
            let fresh = self
                .labels
                .get(&uuid)
                .is_some_and(|k| k.at.elapsed() < LABELS_KEPT);
            if !fresh {
                let labels = read_labels(nvml, index, &d);
                self.labels.insert(
                    uuid.clone(),
                    KeptLabels {
                        at: Instant::now(),
                        labels,
                    },
                );
            }
            self.labels[&uuid]
                .labels
                .iter()
                .filter(|(f, _)| want.wants(*f))
                .cloned()
                .collect()
        } else {
            Vec::new()
        };
        let mig_fb = [Field::FbFree, Field::FbUsed, Field::FbTotal];
        let mig_gpm: Vec<&(Field, GpmMetricId, f64, bool)> = if has_gpm {
            gpm.iter().copied().filter(|(.., per_gi)| *per_gi).collect()
        } else {
            Vec::new()
        };
        let wants_fb = mig_fb.iter().any(|f| want.wants(*f));
        let mut mig = Vec::new();
        // Real H100: MIG mode 163.8 µs.
        if (wants_fb || !mig_gpm.is_empty())
            && optional(d.mig_mode())?.is_some_and(|m| m.current == 1)
        {
            let total = optional(d.memory_info())?.map_or(0, |m| m.total / (1024 * 1024));
            // Real H100: 160.8 µs.
            for slot in 0..d.mig_device_count()? {
                let m = match d.mig_device_by_index(slot) {
                    Ok(m) => m,
                    Err(NvmlError::NotFound) => continue,
                    Err(e) => return Err(e),
                };
                let a = m.attributes()?;
                let mig_uuid = m.uuid()?;
                seen.insert(mig_uuid.clone());
                let gi = super::nvml::instance_id(&nvml.lib().nvmlDeviceGetGpuInstanceId, &m);
                let mut values = Vec::new();
                if wants_fb && let Some(mem) = reading(index, "MIG memory", m.memory_info()) {
                    values.push((Field::FbFree, whole_mib(mem.free)));
                    values.push((Field::FbUsed, whole_mib(mem.used)));
                    values.push((Field::FbTotal, whole_mib(mem.total)));
                }
                // The GPU instance's own GPM sample, taken on its parent
                // (nvmlGpmMigSampleGet; not measured on the real H100, the
                // fake charges what a whole GPU's sample cost, 54.9 µs).
                if let Some(gi) = gi.filter(|_| !mig_gpm.is_empty())
                    && !self.no_gpm.contains(&mig_uuid)
                {
                    match d.gpm_mig_sample(gi) {
                        Ok(cur) => gpm_between(
                            nvml,
                            &mut self.gpm,
                            &mig_uuid,
                            cur,
                            &mig_gpm,
                            index,
                            &mut values,
                        ),
                        Err(NvmlError::NotSupported | NvmlError::FailedToLoadSymbol(_)) => {
                            self.no_gpm.insert(mig_uuid.clone());
                        }
                        Err(e) => {
                            tracing::warn!(gpu = index, device = %mig_uuid, error = %e, "NVML GPM MIG sample failed")
                        }
                    }
                }
                values.retain(|(f, _)| want.wants(*f));
                mig.push(MigSample {
                    uuid: mig_uuid,
                    gpu_instance_id: gi,
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
            labels,
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
