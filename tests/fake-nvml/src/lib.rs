//! A fake `libnvidia-ml.so.1`.
//!
//! It exports the NVML C functions gpu-agent's nvml-wrapper backend calls and
//! answers them from a node description (see the `simnode` crate) named by
//! the environment variable `FAKE_NVML_NODE` (a file path or a built-in name).
//! Anything the description does not say is answered with
//! `NVML_ERROR_NOT_SUPPORTED`, never with made-up data. Functions that are not
//! exported fail in nvml-wrapper with `FailedToLoadSymbol` when called.
//!
//! Without `FAKE_NVML_NODE`, or for a description with no driver, `nvmlInit`
//! fails with `NVML_ERROR_DRIVER_NOT_LOADED`, as the real library does on a
//! node without the driver.
//!
//! Environment:
//! - `FAKE_NVML_NODE`: the node description (file or built-in name).
//! - `FAKE_NVML_EVENTS`: a file a test appends event lines to;
//!   `nvmlEventSetWait` reads the new ones: `<UUID or index> xid <n>`,
//!   `<UUID or index> dbe` (double-bit ECC), or `fail` (the wait returns
//!   `NVML_ERROR_UNKNOWN`). Without it, a wait sleeps its whole timeout.
//! - `FAKE_NVML_STATE`: a file read at each call, lines `<UUID or index>
//!   <word>`: `hot` (the temperature reads 95 °C; the slowdown threshold is
//!   90 °C), `retired-pending` (retired pages wait for a reset; also the
//!   `NVML_FI_DEV_RETIRED_PENDING` field of a GPU before Ampere),
//!   `remapped-pending` (remapped rows wait for a reset), `lost` (every call
//!   about the GPU answers `NVML_ERROR_GPU_IS_LOST`), `busy`
//!   (`nvmlDeviceSetMigMode` answers `NVML_ERROR_IN_USE`), `reset-ignored`
//!   (a reset written to the GPU's sysfs file does nothing: only a reboot
//!   could apply a pending MIG mode), and `process <pid>` (a compute process
//!   in `nvmlDeviceGetComputeRunningProcesses_v3`; on a MIG device's UUID
//!   it runs there, and `nvmlComputeInstanceDestroy` answers `IN_USE`).
//! - `FAKE_NVML_MIG`: a JSON file holding the whole MIG state (the
//!   `simnode::mig::state::NodeMig` of the node: per GPU its mode, current
//!   and pending, and its GPU instances with their compute instances).
//!   Loaded at `nvmlInit` when it exists and is about the same GPUs, else
//!   made from the description; written atomically after every change and
//!   read again when it changed, so processes share one layout. Without it
//!   the state lives in the process.
//! - `FAKE_NVML_SYSFS`: a sysfs tree (the test host's `sys`). Writing a
//!   GPU's `bus/pci/devices/<bus id>/reset` resets it: its pending MIG mode
//!   applies and its GPU instances are gone.
//! - `FAKE_NVML_COSTS`: what each call costs in time. Unset (or `on`):
//!   every call lasts as long as the real library took on a real H100
//!   (`costs/h100-pcie-vm.txt`, built in: `nvmlInit` 10.7 ms the first time
//!   in a process and 2.1 ms after, most calls 2–10 µs, MIG mode ~164 µs,
//!   the PCIe replay counter ~173 µs, violation status 0.74 ms, total energy
//!   3.2 ms, an event registration 2.1 ms; the calls it did not measure as
//!   `costs/modelled.txt` models them on measured ones; a field-values call
//!   the sum of its fields; a call named nowhere the table's median p50,
//!   2.75 µs). `off`: no cost (a test of behaviour that
//!   makes many calls and times nothing may ask for it; a figure measured
//!   with it must say so). `<file>`: another table in the same format
//!   (`costs/README.md`). A table that cannot be read makes `nvmlInit` fail
//!   with `NVML_ERROR_UNKNOWN`, the reason on stderr. See `costs.rs`.
//!
//! Fabric (`nvmlDeviceGetGpuFabricInfo`, `…InfoV` versions 2 and 3): a
//! GPU's `fabric` in the description (cluster UUID, clique, state, status)
//! for a GB200-like node; `NVML_ERROR_NOT_SUPPORTED` for a GPU without one
//! (PCIe and HGX GPUs); see `fabric.rs`.
//!
//! MIG: the mode, GPU-instance and compute-instance profiles, placements,
//! instances and MIG devices follow `simnode::mig` (NVIDIA's published
//! profiles per model and NVML's rules); see `mig.rs`.
//!
//! Readings (clocks, temperatures, power, energy, utilisations, framebuffer,
//! field values — NVLink traffic per link or over all links (`scopeId`),
//! NVLink error counters, ECC counts, retired pages, clock-throttle time —,
//! the board's brand, architecture, serial, VBIOS and InfoROM versions,
//! NVML's version, the vGPU licence, GPM per GPU and per GPU instance) come
//! from `simnode::readings`: gauges as described, counters growing with the
//! time since the library was first initialised; see `metrics.rs`.

#![allow(non_snake_case, clippy::missing_safety_doc)]

mod compute_mode;
pub mod costs;
mod fabric;
mod metrics;
mod mig;

use std::ffi::{c_char, c_int, c_uint};
use std::sync::Mutex;

use mig::{is_mig_handle, with_mig_device};
use nvml_wrapper_sys::bindings::{
    nvmlDevice_t, nvmlEventData_t, nvmlEventSet_t, nvmlGpuTopologyLevel_t, nvmlMemory_t,
    nvmlMemory_v2_t, nvmlPciInfo_t, nvmlReturn_t, nvmlUtilization_t,
};
use simnode::{GpuDesc, NodeDescription};

const SUCCESS: nvmlReturn_t = 0;
const ERROR_UNINITIALIZED: nvmlReturn_t = 1;
const ERROR_INVALID_ARGUMENT: nvmlReturn_t = 2;
const ERROR_NOT_SUPPORTED: nvmlReturn_t = 3;
const ERROR_NOT_FOUND: nvmlReturn_t = 6;
const ERROR_INSUFFICIENT_SIZE: nvmlReturn_t = 7;
const ERROR_DRIVER_NOT_LOADED: nvmlReturn_t = 9;
const ERROR_TIMEOUT: nvmlReturn_t = 10;
const ERROR_GPU_IS_LOST: nvmlReturn_t = 15;
const ERROR_UNKNOWN: nvmlReturn_t = 999;

/// `NVML_TEMPERATURE_GPU`
const TEMPERATURE_GPU: c_uint = 0;

struct State {
    node: NodeDescription,
    /// The node's MIG state (mode, instances), live.
    mig: mig::MigStore,
    inits: u32,
    /// When the library was first initialised: counters grow from here.
    loaded: std::time::Instant,
}

/// Seconds since the library was first initialised.
fn since_load() -> f64 {
    let guard = STATE.lock().unwrap_or_else(|p| p.into_inner());
    guard
        .as_ref()
        .map_or(0.0, |s| s.loaded.elapsed().as_secs_f64())
}

static STATE: Mutex<Option<State>> = Mutex::new(None);

/// Runs `f` with the loaded description, or returns `ERROR_UNINITIALIZED`.
fn with_node(f: impl FnOnce(&NodeDescription) -> nvmlReturn_t) -> nvmlReturn_t {
    let guard = STATE.lock().unwrap_or_else(|p| p.into_inner());
    match guard.as_ref() {
        Some(s) if s.inits > 0 => f(&s.node),
        _ => ERROR_UNINITIALIZED,
    }
}

/// Runs `f` with the GPU behind `device`.
fn with_gpu(
    device: nvmlDevice_t,
    f: impl FnOnce(&NodeDescription, usize, &GpuDesc) -> nvmlReturn_t,
) -> nvmlReturn_t {
    with_node(|node| match handle_index(device, node) {
        Some(i)
            if conditions_of(i, &node.gpus[i].uuid)
                .iter()
                .any(|w| w == "lost") =>
        {
            ERROR_GPU_IS_LOST
        }
        Some(i) => f(node, i, &node.gpus[i]),
        None => ERROR_INVALID_ARGUMENT,
    })
}

/// Writes `value` through `out`: `SUCCESS`, or `NOT_SUPPORTED` for `None`.
unsafe fn answer<T>(out: *mut T, value: Option<T>) -> nvmlReturn_t {
    if out.is_null() {
        return ERROR_INVALID_ARGUMENT;
    }
    match value {
        Some(v) => {
            // SAFETY: non-null, and the caller passes a pointer to a T.
            unsafe { out.write(v) };
            SUCCESS
        }
        None => ERROR_NOT_SUPPORTED,
    }
}

/// Handles are the GPU's index + 1 in disguise (never dereferenced).
fn handle_for(index: usize) -> nvmlDevice_t {
    (index + 1) as nvmlDevice_t
}

fn handle_index(device: nvmlDevice_t, node: &NodeDescription) -> Option<usize> {
    let raw = device as usize;
    (raw >= 1 && raw <= node.gpus.len()).then(|| raw - 1)
}

/// Copies `s` with its NUL into a C buffer of `len` bytes.
unsafe fn write_cstr(s: &str, buf: *mut c_char, len: c_uint) -> nvmlReturn_t {
    if buf.is_null() {
        return ERROR_INVALID_ARGUMENT;
    }
    let bytes = s.as_bytes();
    if bytes.len() + 1 > len as usize {
        return ERROR_INSUFFICIENT_SIZE;
    }
    // SAFETY: the caller gave a buffer of `len` bytes; we write len(s)+1 <= len.
    unsafe {
        std::ptr::copy_nonoverlapping(bytes.as_ptr().cast::<c_char>(), buf, bytes.len());
        *buf.add(bytes.len()) = 0;
    }
    SUCCESS
}

fn fill_pci(
    addr: hostlib::PciAddress,
    device_id: Option<u16>,
    subsystem: Option<u16>,
) -> nvmlPciInfo_t {
    // SAFETY: nvmlPciInfo_t is plain C data; all-zero is a valid value.
    let mut info: nvmlPciInfo_t = unsafe { std::mem::zeroed() };
    info.domain = addr.domain;
    info.bus = u32::from(addr.bus);
    info.device = u32::from(addr.device);
    info.pciDeviceId = device_id.map_or(0, |d| {
        (u32::from(d) << 16) | u32::from(hostlib::pci::NVIDIA_VENDOR)
    });
    info.pciSubSystemId = subsystem.map_or(0, |s| {
        (u32::from(s) << 16) | u32::from(hostlib::pci::NVIDIA_VENDOR)
    });
    let full = addr.nvml_bus_id();
    let legacy = format!(
        "{:04X}:{:02X}:{:02X}.{:X}",
        addr.domain, addr.bus, addr.device, addr.function
    );
    for (dst, src) in [
        (&mut info.busId[..], full),
        (&mut info.busIdLegacy[..], legacy),
    ] {
        for (d, s) in dst.iter_mut().zip(src.bytes()) {
            *d = s as c_char;
        }
    }
    info
}

#[unsafe(no_mangle)]
pub extern "C" fn nvmlInit_v2() -> nvmlReturn_t {
    let _cost = match costs::charge_init() {
        Ok(c) => c,
        Err(e) => {
            eprintln!("fake libnvidia-ml: {e}");
            return ERROR_UNKNOWN;
        }
    };
    let mut guard = STATE.lock().unwrap_or_else(|p| p.into_inner());
    if let Some(s) = guard.as_mut() {
        s.inits += 1;
        return SUCCESS;
    }
    let Ok(name) = std::env::var("FAKE_NVML_NODE") else {
        eprintln!(
            "fake libnvidia-ml: FAKE_NVML_NODE is not set; behaving as a node without a driver"
        );
        return ERROR_DRIVER_NOT_LOADED;
    };
    match NodeDescription::load(&name) {
        Ok(node) if node.driver.is_none() => ERROR_DRIVER_NOT_LOADED,
        Ok(node) => match mig::MigStore::load(&node) {
            Ok(mig) => {
                *guard = Some(State {
                    node,
                    mig,
                    inits: 1,
                    loaded: std::time::Instant::now(),
                });
                SUCCESS
            }
            Err(e) => {
                eprintln!("fake libnvidia-ml: {name}: {e}");
                ERROR_UNKNOWN
            }
        },
        Err(e) => {
            eprintln!("fake libnvidia-ml: {e}");
            ERROR_UNKNOWN
        }
    }
}

#[unsafe(no_mangle)]
pub extern "C" fn nvmlInitWithFlags(_flags: c_uint) -> nvmlReturn_t {
    nvmlInit_v2()
}

#[unsafe(no_mangle)]
pub extern "C" fn nvmlShutdown() -> nvmlReturn_t {
    let _cost = costs::charge("nvmlShutdown");
    let mut guard = STATE.lock().unwrap_or_else(|p| p.into_inner());
    match guard.as_mut() {
        Some(s) if s.inits > 1 => {
            s.inits -= 1;
            SUCCESS
        }
        Some(_) => {
            *guard = None;
            SUCCESS
        }
        None => ERROR_UNINITIALIZED,
    }
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlSystemGetDriverVersion(
    version: *mut c_char,
    length: c_uint,
) -> nvmlReturn_t {
    let _cost = costs::charge("nvmlSystemGetDriverVersion");
    with_node(|n| match &n.driver {
        // SAFETY: forwarded caller buffer.
        Some(d) => unsafe { write_cstr(&d.version, version, length) },
        None => ERROR_DRIVER_NOT_LOADED,
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlSystemGetCudaDriverVersion_v2(version: *mut c_int) -> nvmlReturn_t {
    let _cost = costs::charge("nvmlSystemGetCudaDriverVersion_v2");
    // SAFETY: `version` is the caller's out-pointer.
    with_node(|n| unsafe {
        answer(
            version,
            n.driver.as_ref().and_then(|d| d.cuda_version_int()),
        )
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlSystemGetCudaDriverVersion(version: *mut c_int) -> nvmlReturn_t {
    let _cost = costs::charge("nvmlSystemGetCudaDriverVersion");
    // SAFETY: same contract.
    unsafe { nvmlSystemGetCudaDriverVersion_v2(version) }
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetCount_v2(count: *mut c_uint) -> nvmlReturn_t {
    let _cost = costs::charge("nvmlDeviceGetCount_v2");
    // SAFETY: `count` is the caller's out-pointer.
    with_node(|n| unsafe { answer(count, Some(n.gpus.len() as c_uint)) })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetHandleByIndex_v2(
    index: c_uint,
    device: *mut nvmlDevice_t,
) -> nvmlReturn_t {
    let _cost = costs::charge("nvmlDeviceGetHandleByIndex_v2");
    if device.is_null() {
        return ERROR_INVALID_ARGUMENT;
    }
    with_node(|n| {
        if index as usize >= n.gpus.len() {
            return ERROR_INVALID_ARGUMENT;
        }
        // SAFETY: checked non-null above.
        unsafe { *device = handle_for(index as usize) };
        SUCCESS
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetHandleByPciBusId_v2(
    bus_id: *const c_char,
    device: *mut nvmlDevice_t,
) -> nvmlReturn_t {
    let _cost = costs::charge("nvmlDeviceGetHandleByPciBusId_v2");
    if bus_id.is_null() || device.is_null() {
        return ERROR_INVALID_ARGUMENT;
    }
    // SAFETY: the caller passes a NUL-terminated string.
    let text = unsafe { std::ffi::CStr::from_ptr(bus_id) }
        .to_string_lossy()
        .into_owned();
    let Ok(addr) = text.parse::<hostlib::PciAddress>() else {
        return ERROR_INVALID_ARGUMENT;
    };
    with_node(|n| match n.gpus.iter().position(|g| g.bus_id == addr) {
        Some(i) => {
            // SAFETY: checked non-null above.
            unsafe { *device = handle_for(i) };
            SUCCESS
        }
        None => ERROR_NOT_FOUND,
    })
}

/// By GPU UUID (MIG UUIDs are not handles here). NVIDIA's device plugin
/// looks GPUs up this way in its health check, so an incumbent run against
/// this library is measured doing the same work as ours.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetHandleByUUID(
    uuid: *const c_char,
    device: *mut nvmlDevice_t,
) -> nvmlReturn_t {
    let _cost = costs::charge("nvmlDeviceGetHandleByUUID");
    if uuid.is_null() || device.is_null() {
        return ERROR_INVALID_ARGUMENT;
    }
    // SAFETY: the caller passes a NUL-terminated string.
    let text = unsafe { std::ffi::CStr::from_ptr(uuid) }.to_string_lossy();
    with_node(|n| match n.gpus.iter().position(|g| g.uuid == text) {
        Some(i) => {
            // SAFETY: checked non-null above.
            unsafe { *device = handle_for(i) };
            SUCCESS
        }
        None => ERROR_NOT_FOUND,
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetIndex(
    device: nvmlDevice_t,
    index: *mut c_uint,
) -> nvmlReturn_t {
    let _cost = costs::charge("nvmlDeviceGetIndex");
    // SAFETY: `index` is the caller's out-pointer.
    with_gpu(device, |_, i, _| unsafe {
        answer(index, Some(i as c_uint))
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetMinorNumber(
    device: nvmlDevice_t,
    minor: *mut c_uint,
) -> nvmlReturn_t {
    let _cost = costs::charge("nvmlDeviceGetMinorNumber");
    // SAFETY: same contract; /dev/nvidiaN's N is the index here.
    unsafe { nvmlDeviceGetIndex(device, minor) }
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetName(
    device: nvmlDevice_t,
    name: *mut c_char,
    length: c_uint,
) -> nvmlReturn_t {
    let _cost = costs::charge("nvmlDeviceGetName");
    // SAFETY: forwarded caller buffer.
    with_gpu(device, |_, _, g| unsafe {
        write_cstr(&g.name, name, length)
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetUUID(
    device: nvmlDevice_t,
    uuid: *mut c_char,
    length: c_uint,
) -> nvmlReturn_t {
    let _cost = costs::charge("nvmlDeviceGetUUID");
    if is_mig_handle(device) {
        // SAFETY: forwarded caller buffer.
        return with_mig_device(device, |m| unsafe { write_cstr(&m.uuid, uuid, length) });
    }
    // SAFETY: forwarded caller buffer.
    with_gpu(device, |_, _, g| unsafe {
        write_cstr(&g.uuid, uuid, length)
    })
}

/// What the driver reserves (NVML's v2 `reserved`, not counted in `used`).
fn reserved_bytes(g: &GpuDesc) -> u64 {
    simnode::readings::FB_RESERVED_MIB.min(g.memory_mib) * 1024 * 1024
}

fn memory_numbers(g: &GpuDesc) -> Option<(u64, u64)> {
    let total = g.memory_mib * 1024 * 1024;
    let used = g.memory_used_mib * 1024 * 1024;
    (used <= total).then_some((total, used))
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetMemoryInfo_v2(
    device: nvmlDevice_t,
    memory: *mut nvmlMemory_v2_t,
) -> nvmlReturn_t {
    let _cost = costs::charge("nvmlDeviceGetMemoryInfo_v2");
    if is_mig_handle(device) {
        // A MIG device: its own memory, none of it in use.
        return with_mig_device(device, |m| {
            let total = m.memory_mib * 1024 * 1024;
            // SAFETY: `memory` is the caller's out-pointer.
            unsafe {
                answer(
                    memory,
                    Some(nvmlMemory_v2_t {
                        version: if memory.is_null() {
                            0
                        } else {
                            (*memory).version
                        },
                        total,
                        reserved: 0,
                        used: 0,
                        free: total,
                    }),
                )
            }
        });
    }
    with_gpu(device, |_, _, g| {
        let info = memory_numbers(g).map(|(total, used)| nvmlMemory_v2_t {
            // SAFETY: `memory` is non-null (checked in `answer` before any write);
            // keep the version the caller set.
            version: if memory.is_null() {
                0
            } else {
                unsafe { (*memory).version }
            },
            total,
            reserved: reserved_bytes(g),
            used,
            free: total.saturating_sub(used + reserved_bytes(g)),
        });
        // SAFETY: `memory` is the caller's out-pointer.
        unsafe { answer(memory, info) }
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetMemoryInfo(
    device: nvmlDevice_t,
    memory: *mut nvmlMemory_t,
) -> nvmlReturn_t {
    let _cost = costs::charge("nvmlDeviceGetMemoryInfo");
    with_gpu(device, |_, _, g| {
        let info = memory_numbers(g).map(|(total, used)| nvmlMemory_t {
            total,
            used,
            free: total - used,
        });
        // SAFETY: `memory` is the caller's out-pointer.
        unsafe { answer(memory, info) }
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetPciInfo_v3(
    device: nvmlDevice_t,
    pci: *mut nvmlPciInfo_t,
) -> nvmlReturn_t {
    let _cost = costs::charge("nvmlDeviceGetPciInfo_v3");
    // SAFETY: `pci` is the caller's out-pointer.
    with_gpu(device, |_, _, g| unsafe {
        answer(
            pci,
            Some(fill_pci(
                g.bus_id,
                Some(g.device_id.0),
                g.subsystem_id.map(|s| s.0),
            )),
        )
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetCudaComputeCapability(
    device: nvmlDevice_t,
    major: *mut c_int,
    minor: *mut c_int,
) -> nvmlReturn_t {
    let _cost = costs::charge("nvmlDeviceGetCudaComputeCapability");
    if major.is_null() || minor.is_null() {
        return ERROR_INVALID_ARGUMENT;
    }
    with_gpu(device, |_, _, g| match g.compute_capability() {
        Some((a, b)) => {
            // SAFETY: checked non-null above.
            unsafe {
                *major = a as c_int;
                *minor = b as c_int;
            }
            SUCCESS
        }
        None => ERROR_NOT_SUPPORTED,
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetNvLinkState(
    device: nvmlDevice_t,
    link: c_uint,
    is_active: *mut c_uint,
) -> nvmlReturn_t {
    let _cost = costs::charge("nvmlDeviceGetNvLinkState");
    if is_active.is_null() {
        return ERROR_INVALID_ARGUMENT;
    }
    with_gpu(device, |_, _, g| {
        if g.nvlinks.is_empty() {
            return ERROR_NOT_SUPPORTED;
        }
        if link >= simnode::MAX_NVLINKS {
            return ERROR_INVALID_ARGUMENT;
        }
        let active = (link as usize) < NodeDescription::nvlink_remotes(g).len();
        // SAFETY: checked non-null above.
        unsafe { *is_active = c_uint::from(active) };
        SUCCESS
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetNvLinkRemotePciInfo_v2(
    device: nvmlDevice_t,
    link: c_uint,
    pci: *mut nvmlPciInfo_t,
) -> nvmlReturn_t {
    let _cost = costs::charge("nvmlDeviceGetNvLinkRemotePciInfo_v2");
    if pci.is_null() {
        return ERROR_INVALID_ARGUMENT;
    }
    with_gpu(device, |node, _, g| {
        if g.nvlinks.is_empty() {
            return ERROR_NOT_SUPPORTED;
        }
        let remotes = NodeDescription::nvlink_remotes(g);
        let Some(remote) = remotes.get(link as usize) else {
            return ERROR_INVALID_ARGUMENT;
        };
        let device_id = node.gpu_by_bus(*remote).map(|r| r.device_id.0);
        // SAFETY: checked non-null above.
        unsafe { *pci = fill_pci(*remote, device_id, None) };
        SUCCESS
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetTopologyCommonAncestor(
    device1: nvmlDevice_t,
    device2: nvmlDevice_t,
    path_info: *mut nvmlGpuTopologyLevel_t,
) -> nvmlReturn_t {
    let _cost = costs::charge("nvmlDeviceGetTopologyCommonAncestor");
    with_node(
        |node| match (handle_index(device1, node), handle_index(device2, node)) {
            // SAFETY: `path_info` is the caller's out-pointer.
            (Some(a), Some(b)) => unsafe {
                answer(
                    path_info,
                    Some(node.pcie_level(a, b) as nvmlGpuTopologyLevel_t),
                )
            },
            _ => ERROR_INVALID_ARGUMENT,
        },
    )
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetTemperature(
    device: nvmlDevice_t,
    sensor: c_uint,
    temp: *mut c_uint,
) -> nvmlReturn_t {
    let _cost = costs::charge("nvmlDeviceGetTemperature");
    if sensor != TEMPERATURE_GPU {
        return ERROR_INVALID_ARGUMENT;
    }
    with_gpu(device, |_, i, g| {
        let hot = conditions_of(i, &g.uuid).iter().any(|w| w == "hot");
        let t = if hot {
            Some(HOT_C)
        } else {
            g.telemetry.temperature_c
        };
        // SAFETY: `temp` is the caller's out-pointer.
        unsafe { answer(temp, t) }
    })
}

/// The condition words `FAKE_NVML_STATE` gives GPU `index` (`uuid`).
fn conditions_of(index: usize, uuid: &str) -> Vec<String> {
    let Some(text) = std::env::var("FAKE_NVML_STATE")
        .ok()
        .and_then(|p| std::fs::read_to_string(p).ok())
    else {
        return Vec::new();
    };
    text.lines()
        .filter_map(|l| l.split_once(' '))
        .filter(|(who, _)| *who == uuid || who.parse::<usize>().ok() == Some(index))
        .map(|(_, word)| word.trim().to_string())
        .collect()
}

/// A `hot` GPU's temperature.
const HOT_C: c_uint = 95;
const SLOWDOWN_C: c_uint = simnode::SLOWDOWN_TEMPERATURE_C;
const TEMPERATURE_THRESHOLD_SLOWDOWN: c_uint = 1;

#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetTemperatureThreshold(
    device: nvmlDevice_t,
    threshold: c_uint,
    temp: *mut c_uint,
) -> nvmlReturn_t {
    let _cost = costs::charge("nvmlDeviceGetTemperatureThreshold");
    if threshold != TEMPERATURE_THRESHOLD_SLOWDOWN {
        return ERROR_NOT_SUPPORTED;
    }
    // SAFETY: `temp` is the caller's out-pointer.
    with_gpu(device, |_, _, _| unsafe { answer(temp, Some(SLOWDOWN_C)) })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetRetiredPagesPendingStatus(
    device: nvmlDevice_t,
    pending: *mut c_uint,
) -> nvmlReturn_t {
    let _cost = costs::charge("nvmlDeviceGetRetiredPagesPendingStatus");
    with_gpu(device, |_, i, g| {
        let yes = conditions_of(i, &g.uuid)
            .iter()
            .any(|w| w == "retired-pending");
        // SAFETY: `pending` is the caller's out-pointer.
        unsafe { answer(pending, Some(yes as c_uint)) }
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetRemappedRows(
    device: nvmlDevice_t,
    corr: *mut c_uint,
    unc: *mut c_uint,
    pending: *mut c_uint,
    failure: *mut c_uint,
) -> nvmlReturn_t {
    let _cost = costs::charge("nvmlDeviceGetRemappedRows");
    if corr.is_null() || unc.is_null() || pending.is_null() || failure.is_null() {
        return ERROR_INVALID_ARGUMENT;
    }
    with_gpu(device, |_, i, g| {
        let yes = conditions_of(i, &g.uuid)
            .iter()
            .any(|w| w == "remapped-pending");
        // SAFETY: the four out-pointers were checked non-null above.
        unsafe {
            *corr = 0;
            *unc = yes as c_uint;
            *pending = yes as c_uint;
            *failure = 0;
        }
        SUCCESS
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetPowerUsage(
    device: nvmlDevice_t,
    power: *mut c_uint,
) -> nvmlReturn_t {
    let _cost = costs::charge("nvmlDeviceGetPowerUsage");
    // SAFETY: `power` is the caller's out-pointer.
    with_gpu(device, |_, _, g| unsafe {
        answer(power, g.telemetry.power_mw)
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetUtilizationRates(
    device: nvmlDevice_t,
    util: *mut nvmlUtilization_t,
) -> nvmlReturn_t {
    let _cost = costs::charge("nvmlDeviceGetUtilizationRates");
    with_gpu(device, |_, _, g| {
        let t = &g.telemetry;
        let rates = t
            .utilization_gpu
            .zip(t.utilization_memory)
            .map(|(gpu, memory)| nvmlUtilization_t { gpu, memory });
        // SAFETY: `util` is the caller's out-pointer.
        unsafe { answer(util, rates) }
    })
}

// --- Events -----------------------------------------------------------------

/// `nvmlEventTypeSingleBitEccError | DoubleBitEccError | XidCriticalError`.
const SUPPORTED_EVENTS: u64 = 1 | 2 | 8;
const EVENT_DOUBLE_BIT_ECC: u64 = 2;
const EVENT_XID: u64 = 8;

/// An event set: the registered (GPU index, event mask) pairs and how far
/// into the events file it has read.
struct EventSet {
    registered: Vec<(usize, u64)>,
    offset: u64,
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlEventSetCreate(set: *mut nvmlEventSet_t) -> nvmlReturn_t {
    let _cost = costs::charge("nvmlEventSetCreate");
    if set.is_null() {
        return ERROR_INVALID_ARGUMENT;
    }
    with_node(|_| {
        // Start at the end of the file: only events written from now on count.
        let offset = std::env::var("FAKE_NVML_EVENTS")
            .ok()
            .and_then(|p| std::fs::metadata(p).ok())
            .map_or(0, |m| m.len());
        let boxed = Box::new(EventSet {
            registered: Vec::new(),
            offset,
        });
        // SAFETY: checked non-null; the caller frees it with nvmlEventSetFree.
        unsafe { *set = Box::into_raw(boxed).cast() };
        SUCCESS
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlEventSetFree(set: nvmlEventSet_t) -> nvmlReturn_t {
    let _cost = costs::charge("nvmlEventSetFree");
    if set.is_null() {
        return ERROR_INVALID_ARGUMENT;
    }
    // SAFETY: made by nvmlEventSetCreate from a Box<EventSet>.
    drop(unsafe { Box::from_raw(set.cast::<EventSet>()) });
    SUCCESS
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetSupportedEventTypes(
    device: nvmlDevice_t,
    types: *mut u64,
) -> nvmlReturn_t {
    let _cost = costs::charge("nvmlDeviceGetSupportedEventTypes");
    // SAFETY: `types` is the caller's out-pointer.
    with_gpu(device, |_, _, _| unsafe {
        answer(types, Some(SUPPORTED_EVENTS))
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceRegisterEvents(
    device: nvmlDevice_t,
    types: u64,
    set: nvmlEventSet_t,
) -> nvmlReturn_t {
    let _cost = costs::charge("nvmlDeviceRegisterEvents");
    if set.is_null() || types & !SUPPORTED_EVENTS != 0 {
        return ERROR_INVALID_ARGUMENT;
    }
    with_gpu(device, |_, i, _| {
        // SAFETY: made by nvmlEventSetCreate; NVML sets are not shared between threads.
        unsafe { (*set.cast::<EventSet>()).registered.push((i, types)) };
        SUCCESS
    })
}

/// The next complete line of the events file after `offset`.
fn next_line(path: &str, offset: &mut u64) -> Option<String> {
    use std::io::{Read, Seek, SeekFrom};
    let mut f = std::fs::File::open(path).ok()?;
    f.seek(SeekFrom::Start(*offset)).ok()?;
    let mut rest = String::new();
    f.read_to_string(&mut rest).ok()?;
    let end = rest.find('\n')?;
    *offset += end as u64 + 1;
    Some(rest[..end].trim().to_string())
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlEventSetWait_v2(
    set: nvmlEventSet_t,
    data: *mut nvmlEventData_t,
    timeout_ms: u32,
) -> nvmlReturn_t {
    let _cost = costs::charge("nvmlEventSetWait_v2");
    if set.is_null() || data.is_null() {
        return ERROR_INVALID_ARGUMENT;
    }
    // SAFETY: made by nvmlEventSetCreate.
    let set = unsafe { &mut *set.cast::<EventSet>() };
    let deadline =
        std::time::Instant::now() + std::time::Duration::from_millis(u64::from(timeout_ms));
    let path = std::env::var("FAKE_NVML_EVENTS").ok();
    loop {
        while let Some(line) = path.as_deref().and_then(|p| next_line(p, &mut set.offset)) {
            if line == "fail" {
                return ERROR_UNKNOWN;
            }
            let mut words = line.split_whitespace();
            let (Some(who), Some(kind)) = (words.next(), words.next()) else {
                continue;
            };
            let found = with_node(|node| {
                let idx = node
                    .gpus
                    .iter()
                    .position(|g| g.uuid == who)
                    .or_else(|| who.parse::<usize>().ok().filter(|i| *i < node.gpus.len()));
                let Some(idx) = idx else {
                    return ERROR_NOT_FOUND;
                };
                let (event_type, event_data) =
                    match (kind, words.next().and_then(|x| x.parse::<u64>().ok())) {
                        ("xid", Some(xid)) => (EVENT_XID, xid),
                        ("dbe", _) => (EVENT_DOUBLE_BIT_ECC, 0),
                        _ => return ERROR_NOT_FOUND,
                    };
                if !set
                    .registered
                    .iter()
                    .any(|(i, mask)| *i == idx && mask & event_type != 0)
                {
                    return ERROR_NOT_FOUND;
                }
                let ev = nvmlEventData_t {
                    device: handle_for(idx),
                    eventType: event_type,
                    eventData: event_data,
                    gpuInstanceId: u32::MAX,
                    computeInstanceId: u32::MAX,
                };
                // SAFETY: `data` is the caller's out-pointer (checked non-null).
                unsafe { data.write(ev) };
                SUCCESS
            });
            if found == SUCCESS {
                return SUCCESS;
            }
        }
        let now = std::time::Instant::now();
        if now >= deadline {
            return ERROR_TIMEOUT;
        }
        // With no events file nothing can arrive: one sleep to the deadline,
        // as the real library blocks (an agent's idle cost is measured with
        // this library). With one, look at it again in 5 ms.
        let nap = if path.is_some() {
            std::time::Duration::from_millis(5)
        } else {
            deadline - now
        };
        std::thread::sleep(nap.min(deadline - now));
    }
}
