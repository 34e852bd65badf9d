//! GPU fabric registration: `nvmlDeviceGetGpuFabricInfo` (the first
//! struct, no version field) and `nvmlDeviceGetGpuFabricInfoV` (versions 2
//! and 3: `healthMask`, then `healthSummary`).
//!
//! A GPU whose description has `fabric` (a GB200-like node whose NVLinks
//! leave the node) answers its cluster UUID, clique ID, registration state
//! and status; every other GPU (PCIe, HGX boards whose NVSwitches are in
//! the node) answers `NVML_ERROR_NOT_SUPPORTED`, as the real library does
//! (the H100 PCIe capture's nvidia-smi shows the fabric `N/A`). A completed,
//! successful registration reports a healthy fabric (every health bit
//! "false"/"none", summary healthy); others report no health. MIG device
//! handles are refused with `NVML_ERROR_INVALID_ARGUMENT`. A version the
//! library does not know answers `NVML_ERROR_ARGUMENT_VERSION_MISMATCH`.

use nvml_wrapper_sys::bindings::{
    nvmlDevice_t, nvmlGpuFabricInfo_t, nvmlGpuFabricInfo_v2_t, nvmlGpuFabricInfo_v3_t, nvmlReturn_t,
};
use simnode::{FabricDesc, FabricState};

use super::{ERROR_INVALID_ARGUMENT, ERROR_NOT_SUPPORTED, SUCCESS, costs, is_mig_handle, with_gpu};

const ERROR_ARGUMENT_VERSION_MISMATCH: nvmlReturn_t = 25;

/// `NVML_STRUCT_VERSION(GpuFabricInfo, n)`: the struct's size, the version
/// in the top byte.
const fn struct_version(size: usize, version: u32) -> u32 {
    size as u32 | (version << 24)
}
pub const V2: u32 = struct_version(size_of::<nvmlGpuFabricInfo_v2_t>(), 2);
pub const V3: u32 = struct_version(size_of::<nvmlGpuFabricInfo_v3_t>(), 3);

/// The health mask of a healthy fabric: bandwidth not degraded, no route
/// recovery, no unhealthy route, no access-timeout recovery, no incorrect
/// configuration (`NVML_GPU_FABRIC_HEALTH_MASK_*`).
const HEALTHY_MASK: u32 = 2 | (2 << 2) | (2 << 4) | (2 << 6) | (1 << 8);
/// `NVML_GPU_FABRIC_HEALTH_SUMMARY_HEALTHY`.
const HEALTHY_SUMMARY: u8 = 1;

/// What a GPU's registration reports: (cluster UUID, status, clique,
/// state, health mask, health summary).
fn facts(f: &FabricDesc) -> ([u8; 16], nvmlReturn_t, u32, u8, u32, u8) {
    let healthy = f.state == FabricState::Completed && f.status == 0;
    (
        f.cluster_uuid_bytes().unwrap_or_default(),
        f.status,
        f.clique_id,
        f.state.nvml(),
        if healthy { HEALTHY_MASK } else { 0 },
        if healthy { HEALTHY_SUMMARY } else { 0 },
    )
}

/// Runs `fill` with the fabric of the GPU behind `device`.
fn with_fabric(
    device: nvmlDevice_t,
    fill: impl FnOnce(&FabricDesc) -> nvmlReturn_t,
) -> nvmlReturn_t {
    if is_mig_handle(device) {
        return ERROR_INVALID_ARGUMENT;
    }
    with_gpu(device, |_, _, g| match &g.fabric {
        Some(f) => fill(f),
        None => ERROR_NOT_SUPPORTED,
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetGpuFabricInfo(
    device: nvmlDevice_t,
    info: *mut nvmlGpuFabricInfo_t,
) -> nvmlReturn_t {
    let _cost = costs::charge("nvmlDeviceGetGpuFabricInfo");
    if info.is_null() {
        return ERROR_INVALID_ARGUMENT;
    }
    with_fabric(device, |f| {
        let (uuid, status, clique, state, _, _) = facts(f);
        // SAFETY: non-null, and the caller passes a pointer to the struct.
        unsafe {
            (*info).clusterUuid = uuid;
            (*info).status = status;
            (*info).cliqueId = clique;
            (*info).state = state;
        }
        SUCCESS
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetGpuFabricInfoV(
    device: nvmlDevice_t,
    info: *mut nvmlGpuFabricInfo_v3_t,
) -> nvmlReturn_t {
    let _cost = costs::charge("nvmlDeviceGetGpuFabricInfoV");
    if info.is_null() {
        return ERROR_INVALID_ARGUMENT;
    }
    // SAFETY: non-null; every version starts with the version field.
    let version = unsafe { (*info).version };
    if version != V2 && version != V3 {
        return ERROR_ARGUMENT_VERSION_MISMATCH;
    }
    with_fabric(device, |f| {
        let (uuid, status, clique, state, mask, summary) = facts(f);
        if version == V2 {
            let info = info.cast::<nvmlGpuFabricInfo_v2_t>();
            // SAFETY: the caller said (by the version) the struct is a v2.
            unsafe {
                (*info).clusterUuid = uuid;
                (*info).status = status;
                (*info).cliqueId = clique;
                (*info).state = state;
                (*info).healthMask = mask;
            }
        } else {
            // SAFETY: the caller said (by the version) the struct is a v3.
            unsafe {
                (*info).clusterUuid = uuid;
                (*info).status = status;
                (*info).cliqueId = clique;
                (*info).state = state;
                (*info).healthMask = mask;
                (*info).healthSummary = summary;
            }
        }
        SUCCESS
    })
}
