//! The readings the metrics exporter samples: clocks, energy, PCIe replays,
//! encoder/decoder utilisation, field values (memory temperature, NVLink
//! traffic) and GPM (Hopper and newer). Numbers come from
//! [`simnode::readings`]: gauges as described, counters growing with the time
//! since the library was loaded.

use crate::costs;
use std::ffi::{c_int, c_uint, c_ulonglong};

use nvml_wrapper_sys::bindings::{
    nvmlDevice_t, nvmlFieldValue_t, nvmlGpmMetricsGet_t, nvmlGpmSample_t, nvmlGpmSupport_t,
    nvmlReturn_t, nvmlValue_t,
};
use simnode::readings::Readings;

use super::{
    ERROR_INVALID_ARGUMENT, ERROR_NOT_SUPPORTED, SUCCESS, answer, conditions_of, since_load,
    with_gpu,
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

/// `NVML_FI_DEV_MEMORY_TEMP`, `NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_TX/RX`.
const FI_MEMORY_TEMP: c_uint = 82;
const FI_NVLINK_DATA_TX: c_uint = 138;
const FI_NVLINK_DATA_RX: c_uint = 139;
/// `NVML_VALUE_TYPE_UNSIGNED_INT`, `_UNSIGNED_LONG_LONG`.
const VALUE_UINT: c_uint = 1;
const VALUE_ULL: c_uint = 3;

#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetFieldValues(
    device: nvmlDevice_t,
    count: c_int,
    values: *mut nvmlFieldValue_t,
) -> nvmlReturn_t {
    let _cost = costs::charge("nvmlDeviceGetFieldValues");
    if values.is_null() || count < 0 {
        return ERROR_INVALID_ARGUMENT;
    }
    with_readings(device, |r| {
        // SAFETY: the caller passes `count` field values at `values`.
        let fields = unsafe { std::slice::from_raw_parts_mut(values, count as usize) };
        for f in fields {
            let (ty, value) = match f.fieldId {
                FI_MEMORY_TEMP => (VALUE_UINT, r.mem_temp_c.map(|c| nvmlValue_t { uiVal: c })),
                FI_NVLINK_DATA_TX => (
                    VALUE_ULL,
                    r.nvlink_tx_kib.map(|k| nvmlValue_t { ullVal: k }),
                ),
                FI_NVLINK_DATA_RX => (
                    VALUE_ULL,
                    r.nvlink_rx_kib.map(|k| nvmlValue_t { ullVal: k }),
                ),
                _ => (VALUE_UINT, None),
            };
            f.valueType = ty;
            match value {
                Some(v) => {
                    f.value = v;
                    f.nvmlReturn = SUCCESS;
                }
                None => f.nvmlReturn = ERROR_NOT_SUPPORTED,
            }
        }
        SUCCESS
    })
}

// --- GPM ---------------------------------------------------------------------

/// A GPM sample: which GPU, and its figures when taken.
struct GpmSample {
    gpm: Option<simnode::readings::Gpm>,
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
    let b = Box::new(GpmSample { gpm: None });
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
            unsafe { (*(sample as *mut GpmSample)).gpm = Some(g) };
            SUCCESS
        }
        None => ERROR_NOT_SUPPORTED,
    })
}

/// `NVML_GPM_METRIC_GRAPHICS_UTIL`, `_ANY_TENSOR_UTIL`, `_DRAM_BW_UTIL`,
/// `_PCIE_TX_PER_SEC`, `_PCIE_RX_PER_SEC`.
const GPM_GRAPHICS_UTIL: c_uint = 1;
const GPM_ANY_TENSOR_UTIL: c_uint = 5;
const GPM_DRAM_BW_UTIL: c_uint = 10;
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
    for m in &mut req.metrics[..req.numMetrics as usize] {
        let v = match m.metricId {
            GPM_GRAPHICS_UTIL => Some(g.graphics_util_pct),
            GPM_ANY_TENSOR_UTIL => Some(g.tensor_util_pct),
            GPM_DRAM_BW_UTIL => Some(g.dram_bw_util_pct),
            GPM_PCIE_TX_PER_SEC => Some(g.pcie_tx_mib_s),
            GPM_PCIE_RX_PER_SEC => Some(g.pcie_rx_mib_s),
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
