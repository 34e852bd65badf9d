//! The readings the metrics exporter samples: clocks, energy, PCIe replays,
//! encoder/decoder utilisation, field values (memory temperature, NVLink
//! traffic and error counters, ECC counts, retired pages, clock-throttle
//! time), the board's facts (brand, architecture, serial, VBIOS and InfoROM
//! versions), NVML's version, the vGPU licence and GPM (Hopper and newer,
//! per GPU and per GPU instance). Numbers come from [`simnode::readings`]:
//! gauges as described, counters growing with the time since the library
//! was loaded.

use crate::costs;
use std::ffi::{c_char, c_int, c_uint, c_ulonglong};

use nvml_wrapper_sys::bindings::{
    nvmlDevice_t, nvmlFieldValue_t, nvmlGpmMetricsGet_t, nvmlGpmSample_t, nvmlGpmSupport_t,
    nvmlGridLicensableFeatures_t, nvmlReturn_t, nvmlValue_t,
};
use simnode::readings::Readings;

use super::{
    ERROR_INVALID_ARGUMENT, ERROR_NOT_SUPPORTED, SUCCESS, answer, conditions_of, since_load,
    with_gpu, with_node, write_cstr,
};

/// `NVML_CLOCK_GRAPHICS`, `_SM`, `_MEM`, `_VIDEO`.
const CLOCK_GRAPHICS: c_uint = 0;
const CLOCK_SM: c_uint = 1;
const CLOCK_MEM: c_uint = 2;

/// Runs `f` with GPU `device`'s readings now.
fn with_readings(device: nvmlDevice_t, f: impl FnOnce(&Readings) -> nvmlReturn_t) -> nvmlReturn_t {
    let secs = since_load();
    with_gpu(device, |_, i, g| {
        let mut r = g.readings(secs);
        if conditions_of(i, &g.uuid).iter().any(|w| w == "hot") {
            r.gpu_temp_c = Some(super::HOT_C);
        }
        f(&r)
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetClockInfo(
    device: nvmlDevice_t,
    clock: c_uint,
    mhz: *mut c_uint,
) -> nvmlReturn_t {
    let _cost = costs::charge("nvmlDeviceGetClockInfo");
    with_readings(device, |r| {
        let v = match clock {
            CLOCK_GRAPHICS | CLOCK_SM => r.sm_clock_mhz,
            CLOCK_MEM => r.mem_clock_mhz,
            _ => return ERROR_NOT_SUPPORTED,
        };
        // SAFETY: `mhz` is the caller's out-pointer.
        unsafe { answer(mhz, Some(v)) }
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetTotalEnergyConsumption(
    device: nvmlDevice_t,
    energy: *mut c_ulonglong,
) -> nvmlReturn_t {
    let _cost = costs::charge("nvmlDeviceGetTotalEnergyConsumption");
    // SAFETY: `energy` is the caller's out-pointer.
    with_readings(device, |r| unsafe { answer(energy, r.energy_mj) })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetPcieReplayCounter(
    device: nvmlDevice_t,
    value: *mut c_uint,
) -> nvmlReturn_t {
    let _cost = costs::charge("nvmlDeviceGetPcieReplayCounter");
    // SAFETY: `value` is the caller's out-pointer.
    with_readings(device, |r| unsafe {
        answer(value, Some(r.pcie_replays as c_uint))
    })
}

/// NVML's sampling period for encoder/decoder utilisation, µs.
const CODEC_PERIOD_US: c_uint = 167_000;

unsafe fn codec(
    device: nvmlDevice_t,
    util: *mut c_uint,
    period: *mut c_uint,
    pick: fn(&Readings) -> u32,
) -> nvmlReturn_t {
    if util.is_null() || period.is_null() {
        return ERROR_INVALID_ARGUMENT;
    }
    with_readings(device, |r| {
        // SAFETY: both out-pointers were checked non-null above.
        unsafe {
            *util = pick(r);
            *period = CODEC_PERIOD_US;
        }
        SUCCESS
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetEncoderUtilization(
    device: nvmlDevice_t,
    util: *mut c_uint,
    period: *mut c_uint,
) -> nvmlReturn_t {
    let _cost = costs::charge("nvmlDeviceGetEncoderUtilization");
    // SAFETY: forwarded caller pointers.
    unsafe { codec(device, util, period, |r| r.enc_util) }
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetDecoderUtilization(
    device: nvmlDevice_t,
    util: *mut c_uint,
    period: *mut c_uint,
) -> nvmlReturn_t {
    let _cost = costs::charge("nvmlDeviceGetDecoderUtilization");
    // SAFETY: forwarded caller pointers.
    unsafe { codec(device, util, period, |r| r.dec_util) }
}

/// NVML field IDs (`NVML_FI_DEV_*`) the fake answers.
mod fi {
    use std::ffi::c_uint;
    pub const ECC_SBE_VOL_TOTAL: c_uint = 3;
    pub const ECC_DBE_VOL_TOTAL: c_uint = 4;
    pub const ECC_SBE_AGG_TOTAL: c_uint = 5;
    pub const ECC_DBE_AGG_TOTAL: c_uint = 6;
    pub const RETIRED_SBE: c_uint = 29;
    pub const RETIRED_DBE: c_uint = 30;
    pub const RETIRED_PENDING: c_uint = 31;
    pub const NVLINK_CRC_FLIT_ERROR_COUNT_TOTAL: c_uint = 38;
    pub const NVLINK_CRC_DATA_ERROR_COUNT_TOTAL: c_uint = 45;
    pub const NVLINK_REPLAY_ERROR_COUNT_TOTAL: c_uint = 52;
    pub const NVLINK_RECOVERY_ERROR_COUNT_TOTAL: c_uint = 59;
    pub const PERF_POLICY_POWER: c_uint = 74;
    pub const PERF_POLICY_THERMAL: c_uint = 75;
    pub const PERF_POLICY_SYNC_BOOST: c_uint = 76;
    pub const PERF_POLICY_BOARD_LIMIT: c_uint = 77;
    pub const PERF_POLICY_LOW_UTILIZATION: c_uint = 78;
    pub const PERF_POLICY_RELIABILITY: c_uint = 79;
    pub const MEMORY_TEMP: c_uint = 82;
    pub const NVLINK_THROUGHPUT_DATA_TX: c_uint = 138;
    pub const NVLINK_THROUGHPUT_DATA_RX: c_uint = 139;
}
/// `NVML_VALUE_TYPE_UNSIGNED_INT`, `_UNSIGNED_LONG_LONG`.
const VALUE_UINT: c_uint = 1;
const VALUE_ULL: c_uint = 3;
/// A scope of every NVLink (NVML sums the throughput counters over them).
const ALL_LINKS: c_uint = c_uint::MAX;

/// What one field of a field-values call costs: what the call that gives
/// the same figure cost on the real H100 (the table's line for it), else
/// the field-values call's own line (the table's median: it was not
/// measured). A field-values call costs the sum of its fields.
fn field_cost_name(id: c_uint) -> &'static str {
    match id {
        fi::ECC_SBE_VOL_TOTAL..=fi::ECC_DBE_AGG_TOTAL => "nvmlDeviceGetTotalEccErrors",
        fi::RETIRED_SBE | fi::RETIRED_DBE => "nvmlDeviceGetRetiredPages",
        fi::RETIRED_PENDING => "nvmlDeviceGetRetiredPagesPendingStatus",
        fi::NVLINK_CRC_FLIT_ERROR_COUNT_TOTAL
        | fi::NVLINK_CRC_DATA_ERROR_COUNT_TOTAL
        | fi::NVLINK_REPLAY_ERROR_COUNT_TOTAL
        | fi::NVLINK_RECOVERY_ERROR_COUNT_TOTAL => "nvmlDeviceGetNvLinkErrorCounter",
        fi::PERF_POLICY_POWER..=fi::PERF_POLICY_RELIABILITY => "nvmlDeviceGetViolationStatus",
        fi::MEMORY_TEMP => "nvmlDeviceGetTemperature",
        _ => "nvmlDeviceGetFieldValues",
    }
}

/// One field's value: its type and number, `None` where the GPU does not
/// give it. `pending` is the `retired-pending` condition.
fn field_value(r: &Readings, id: c_uint, scope: c_uint, pending: bool) -> Option<(c_uint, u64)> {
    let ull = |v: Option<u64>| v.map(|v| (VALUE_ULL, v));
    let links = u64::from(r.nvlink_links);
    let throughput = || match scope {
        ALL_LINKS => r.nvlink_link_kib.map(|k| k * links),
        l if u64::from(l) < links => r.nvlink_link_kib,
        // An inactive link of a GPU with NVLinks moves nothing.
        l if l < simnode::MAX_NVLINKS => r.nvlink_link_kib.map(|_| 0),
        _ => None,
    };
    let e = r.nvlink_errors;
    let v = r.throttle_ns;
    match id {
        fi::MEMORY_TEMP => r.mem_temp_c.map(|c| (VALUE_UINT, u64::from(c))),
        fi::NVLINK_THROUGHPUT_DATA_TX | fi::NVLINK_THROUGHPUT_DATA_RX => ull(throughput()),
        fi::ECC_SBE_VOL_TOTAL => ull(Some(r.ecc.sbe_volatile)),
        fi::ECC_DBE_VOL_TOTAL => ull(Some(r.ecc.dbe_volatile)),
        fi::ECC_SBE_AGG_TOTAL => ull(Some(r.ecc.sbe_aggregate)),
        fi::ECC_DBE_AGG_TOTAL => ull(Some(r.ecc.dbe_aggregate)),
        fi::RETIRED_SBE => ull(r.retired.map(|p| p.sbe)),
        fi::RETIRED_DBE => ull(r.retired.map(|p| p.dbe)),
        fi::RETIRED_PENDING => r.retired.map(|_| (VALUE_UINT, u64::from(pending))),
        fi::NVLINK_CRC_FLIT_ERROR_COUNT_TOTAL => ull(e.map(|e| e.crc_flit)),
        fi::NVLINK_CRC_DATA_ERROR_COUNT_TOTAL => ull(e.map(|e| e.crc_data)),
        fi::NVLINK_REPLAY_ERROR_COUNT_TOTAL => ull(e.map(|e| e.replay)),
        fi::NVLINK_RECOVERY_ERROR_COUNT_TOTAL => ull(e.map(|e| e.recovery)),
        fi::PERF_POLICY_POWER => ull(Some(v.power)),
        fi::PERF_POLICY_THERMAL => ull(Some(v.thermal)),
        fi::PERF_POLICY_SYNC_BOOST => ull(Some(v.sync_boost)),
        fi::PERF_POLICY_BOARD_LIMIT => ull(Some(v.board_limit)),
        fi::PERF_POLICY_LOW_UTILIZATION => ull(Some(v.low_util)),
        fi::PERF_POLICY_RELIABILITY => ull(Some(v.reliability)),
        _ => None,
    }
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetFieldValues(
    device: nvmlDevice_t,
    count: c_int,
    values: *mut nvmlFieldValue_t,
) -> nvmlReturn_t {
    if values.is_null() || count < 0 {
        let _cost = costs::charge("nvmlDeviceGetFieldValues");
        return ERROR_INVALID_ARGUMENT;
    }
    // SAFETY: the caller passes `count` field values at `values`.
    let fields = unsafe { std::slice::from_raw_parts_mut(values, count as usize) };
    let _cost = costs::charge_all(fields.iter().map(|f| field_cost_name(f.fieldId)));
    let secs = since_load();
    with_gpu(device, |_, i, g| {
        let mut r = g.readings(secs);
        let conditions = conditions_of(i, &g.uuid);
        if conditions.iter().any(|w| w == "hot") {
            r.gpu_temp_c = Some(super::HOT_C);
        }
        let pending = conditions.iter().any(|w| w == "retired-pending");
        for f in fields {
            match field_value(&r, f.fieldId, f.scopeId, pending) {
                Some((ty, v)) => {
                    f.valueType = ty;
                    f.value = if ty == VALUE_UINT {
                        nvmlValue_t { uiVal: v as c_uint }
                    } else {
                        nvmlValue_t { ullVal: v }
                    };
                    f.nvmlReturn = SUCCESS;
                }
                None => {
                    f.valueType = VALUE_UINT;
                    f.nvmlReturn = ERROR_NOT_SUPPORTED;
                }
            }
        }
        SUCCESS
    })
}

// --- The board ---------------------------------------------------------------

#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetBrand(
    device: nvmlDevice_t,
    brand: *mut c_uint,
) -> nvmlReturn_t {
    let _cost = costs::charge("nvmlDeviceGetBrand");
    // SAFETY: `brand` is the caller's out-pointer.
    with_gpu(device, |_, _, g| unsafe {
        answer(brand, Some(g.board().brand))
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetArchitecture(
    device: nvmlDevice_t,
    arch: *mut c_uint,
) -> nvmlReturn_t {
    let _cost = costs::charge("nvmlDeviceGetArchitecture");
    // SAFETY: `arch` is the caller's out-pointer.
    with_gpu(device, |_, _, g| unsafe {
        answer(arch, Some(g.board().architecture))
    })
}

/// Writes one of the board's strings (`None`: not supported) into the
/// caller's buffer of `length` bytes.
fn board_string(
    device: nvmlDevice_t,
    buf: *mut c_char,
    length: c_uint,
    pick: fn(simnode::readings::Board) -> Option<String>,
) -> nvmlReturn_t {
    with_gpu(device, |_, _, g| match pick(g.board()) {
        // SAFETY: the caller's buffer of `length` bytes.
        Some(s) => unsafe { write_cstr(&s, buf, length) },
        None => ERROR_NOT_SUPPORTED,
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetSerial(
    device: nvmlDevice_t,
    serial: *mut c_char,
    length: c_uint,
) -> nvmlReturn_t {
    let _cost = costs::charge("nvmlDeviceGetSerial");
    board_string(device, serial, length, |b| Some(b.serial))
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetVbiosVersion(
    device: nvmlDevice_t,
    version: *mut c_char,
    length: c_uint,
) -> nvmlReturn_t {
    let _cost = costs::charge("nvmlDeviceGetVbiosVersion");
    board_string(device, version, length, |b| Some(b.vbios))
}

/// `NVML_INFOROM_OEM`, `_ECC`, `_POWER`.
const INFOROM_OEM: c_uint = 0;
const INFOROM_ECC: c_uint = 1;
const INFOROM_POWER: c_uint = 2;

#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetInforomVersion(
    device: nvmlDevice_t,
    object: c_uint,
    version: *mut c_char,
    length: c_uint,
) -> nvmlReturn_t {
    let _cost = costs::charge("nvmlDeviceGetInforomVersion");
    let pick: fn(simnode::readings::Board) -> Option<String> = match object {
        INFOROM_OEM => |b| Some(b.inforom_oem),
        INFOROM_ECC => |b| Some(b.inforom_ecc),
        INFOROM_POWER => |b| b.inforom_power,
        _ => return ERROR_INVALID_ARGUMENT,
    };
    board_string(device, version, length, pick)
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetInforomImageVersion(
    device: nvmlDevice_t,
    version: *mut c_char,
    length: c_uint,
) -> nvmlReturn_t {
    let _cost = costs::charge("nvmlDeviceGetInforomImageVersion");
    board_string(device, version, length, |b| Some(b.inforom_image))
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlSystemGetNVMLVersion(
    version: *mut c_char,
    length: c_uint,
) -> nvmlReturn_t {
    let _cost = costs::charge("nvmlSystemGetNVMLVersion");
    with_node(|node| match node.nvml_version() {
        // SAFETY: the caller's buffer of `length` bytes.
        Some(v) => unsafe { write_cstr(&v, version, length) },
        None => ERROR_NOT_SUPPORTED,
    })
}

/// The GPU's GRID licensable features: a bare-metal GPU takes no GRID
/// licence (`isGridLicenseSupported` 0, no features), as
/// `simnode::readings` says (`vgpu_license` 0).
#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetGridLicensableFeatures_v4(
    device: nvmlDevice_t,
    features: *mut nvmlGridLicensableFeatures_t,
) -> nvmlReturn_t {
    let _cost = costs::charge("nvmlDeviceGetGridLicensableFeatures_v4");
    if features.is_null() {
        return ERROR_INVALID_ARGUMENT;
    }
    with_readings(device, |r| {
        // SAFETY: plain C data, all-zero is valid; `features` checked non-null.
        unsafe {
            *features = std::mem::zeroed();
            (*features).isGridLicenseSupported = r.vgpu_license as c_int;
        }
        SUCCESS
    })
}

// --- GPM ---------------------------------------------------------------------

/// A GPM sample: its figures when taken, and whether it is a GPU
/// instance's (MIG), which has no PCIe figures of its own.
struct GpmSample {
    gpm: Option<simnode::readings::Gpm>,
    instance: bool,
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlGpmQueryDeviceSupport(
    device: nvmlDevice_t,
    support: *mut nvmlGpmSupport_t,
) -> nvmlReturn_t {
    let _cost = costs::charge("nvmlGpmQueryDeviceSupport");
    if support.is_null() {
        return ERROR_INVALID_ARGUMENT;
    }
    with_readings(device, |r| {
        // SAFETY: checked non-null above.
        unsafe { (*support).isSupportedDevice = r.gpm.is_some() as c_uint };
        SUCCESS
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlGpmSampleAlloc(sample: *mut nvmlGpmSample_t) -> nvmlReturn_t {
    let _cost = costs::charge("nvmlGpmSampleAlloc");
    if sample.is_null() {
        return ERROR_INVALID_ARGUMENT;
    }
    let b = Box::new(GpmSample {
        gpm: None,
        instance: false,
    });
    // SAFETY: checked non-null above; the pointer is only ever handed back to us.
    unsafe { *sample = Box::into_raw(b) as nvmlGpmSample_t };
    SUCCESS
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlGpmSampleFree(sample: nvmlGpmSample_t) -> nvmlReturn_t {
    let _cost = costs::charge("nvmlGpmSampleFree");
    if sample.is_null() {
        return ERROR_INVALID_ARGUMENT;
    }
    // SAFETY: made by `nvmlGpmSampleAlloc` and freed once (the caller's contract).
    drop(unsafe { Box::from_raw(sample as *mut GpmSample) });
    SUCCESS
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlGpmSampleGet(
    device: nvmlDevice_t,
    sample: nvmlGpmSample_t,
) -> nvmlReturn_t {
    let _cost = costs::charge("nvmlGpmSampleGet");
    if sample.is_null() {
        return ERROR_INVALID_ARGUMENT;
    }
    with_readings(device, |r| match r.gpm {
        Some(g) => {
            // SAFETY: a live sample from `nvmlGpmSampleAlloc`.
            unsafe {
                *(sample as *mut GpmSample) = GpmSample {
                    gpm: Some(g),
                    instance: false,
                }
            };
            SUCCESS
        }
        None => ERROR_NOT_SUPPORTED,
    })
}

/// A GPU instance's sample, taken on its parent GPU: its figures follow
/// `simnode::readings` (`GpuDesc::instance_gpm`). A GPU without MIG on, or
/// an instance ID it does not have, is an invalid argument.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlGpmMigSampleGet(
    device: nvmlDevice_t,
    gpu_instance_id: c_uint,
    sample: nvmlGpmSample_t,
) -> nvmlReturn_t {
    let _cost = costs::charge("nvmlGpmMigSampleGet");
    if sample.is_null() {
        return ERROR_INVALID_ARGUMENT;
    }
    if !crate::mig::has_gpu_instance(device, gpu_instance_id) {
        return ERROR_INVALID_ARGUMENT;
    }
    with_gpu(device, |_, _, g| match g.instance_gpm(gpu_instance_id) {
        Some(x) => {
            // SAFETY: a live sample from `nvmlGpmSampleAlloc`.
            unsafe {
                *(sample as *mut GpmSample) = GpmSample {
                    gpm: Some(x),
                    instance: true,
                }
            };
            SUCCESS
        }
        None => ERROR_NOT_SUPPORTED,
    })
}

/// `NVML_GPM_METRIC_GRAPHICS_UTIL`, `_SM_UTIL`, `_SM_OCCUPANCY`,
/// `_ANY_TENSOR_UTIL`, `_DRAM_BW_UTIL`, `_FP64_UTIL`, `_FP32_UTIL`,
/// `_FP16_UTIL`, `_PCIE_TX_PER_SEC`, `_PCIE_RX_PER_SEC`.
const GPM_GRAPHICS_UTIL: c_uint = 1;
const GPM_SM_UTIL: c_uint = 2;
const GPM_SM_OCCUPANCY: c_uint = 3;
const GPM_ANY_TENSOR_UTIL: c_uint = 5;
const GPM_DRAM_BW_UTIL: c_uint = 10;
const GPM_FP64_UTIL: c_uint = 11;
const GPM_FP32_UTIL: c_uint = 12;
const GPM_FP16_UTIL: c_uint = 13;
const GPM_PCIE_TX_PER_SEC: c_uint = 20;
const GPM_PCIE_RX_PER_SEC: c_uint = 21;

#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlGpmMetricsGet(get: *mut nvmlGpmMetricsGet_t) -> nvmlReturn_t {
    let _cost = costs::charge("nvmlGpmMetricsGet");
    if get.is_null() {
        return ERROR_INVALID_ARGUMENT;
    }
    // SAFETY: checked non-null; the caller owns the request.
    let req = unsafe { &mut *get };
    if req.sample1.is_null() || req.sample2.is_null() || req.numMetrics as usize > req.metrics.len()
    {
        return ERROR_INVALID_ARGUMENT;
    }
    // SAFETY: both samples come from `nvmlGpmSampleAlloc`.
    let (a, b) = unsafe {
        (
            &*(req.sample1 as *const GpmSample),
            &*(req.sample2 as *const GpmSample),
        )
    };
    let (Some(_), Some(g)) = (a.gpm, b.gpm) else {
        return ERROR_INVALID_ARGUMENT;
    };
    if a.instance != b.instance {
        return ERROR_INVALID_ARGUMENT;
    }
    let whole = !b.instance;
    for m in &mut req.metrics[..req.numMetrics as usize] {
        let v = match m.metricId {
            GPM_GRAPHICS_UTIL => Some(g.graphics_util_pct),
            GPM_SM_UTIL => Some(g.sm_util_pct),
            GPM_SM_OCCUPANCY => Some(g.sm_occupancy_pct),
            GPM_ANY_TENSOR_UTIL => Some(g.tensor_util_pct),
            GPM_DRAM_BW_UTIL => Some(g.dram_bw_util_pct),
            GPM_FP64_UTIL => Some(g.fp64_util_pct),
            GPM_FP32_UTIL => Some(g.fp32_util_pct),
            GPM_FP16_UTIL => Some(g.fp16_util_pct),
            GPM_PCIE_TX_PER_SEC => Some(g.pcie_tx_mib_s).filter(|_| whole),
            GPM_PCIE_RX_PER_SEC => Some(g.pcie_rx_mib_s).filter(|_| whole),
            _ => None,
        };
        m.metricInfo.shortName = std::ptr::null_mut();
        m.metricInfo.longName = std::ptr::null_mut();
        m.metricInfo.unit = std::ptr::null_mut();
        match v {
            Some(v) => {
                m.value = v;
                m.nvmlReturn = SUCCESS;
            }
            None => m.nvmlReturn = ERROR_NOT_SUPPORTED,
        }
    }
    SUCCESS
}
