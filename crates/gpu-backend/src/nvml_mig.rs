//! MIG reconfiguration through NVML: GPU and compute instances, which
//! nvml-wrapper 0.13 does not wrap, called through nvml-wrapper-sys's
//! loaded symbols. Mode, processes and handles go through nvml-wrapper.
//! This is the one place with unsafe MIG calls; each says why it is sound.

#![allow(unsafe_code)]

use std::ffi::{CStr, c_uint};

use nvml_wrapper::Device;
use nvml_wrapper::error::{NvmlError, nvml_try};
use nvml_wrapper_sys::bindings::{
    NVML_COMPUTE_INSTANCE_ENGINE_PROFILE_SHARED, NVML_COMPUTE_INSTANCE_PROFILE_COUNT,
    NVML_GPU_INSTANCE_PROFILE_COUNT, nvmlComputeInstance_t, nvmlComputeInstanceInfo_t,
    nvmlComputeInstanceProfileInfo_t, nvmlGpuInstance_t, nvmlGpuInstanceInfo_t,
    nvmlGpuInstancePlacement_t, nvmlGpuInstanceProfileInfo_t, nvmlGpuInstanceProfileInfo_v2_t,
    nvmlReturn_enum_NVML_ERROR_INSUFFICIENT_RESOURCES, nvmlReturn_enum_NVML_ERROR_INVALID_ARGUMENT,
    nvmlReturn_enum_NVML_ERROR_NOT_FOUND, nvmlReturn_enum_NVML_ERROR_NOT_SUPPORTED,
    nvmlReturn_enum_NVML_SUCCESS, nvmlReturn_t,
};

use super::mig_profile_name;
use super::nvml::NvmlBackend;
use gpu_model::mig::{
    CiProfile, ComputeInstance, ErrorKind, GiProfile, GpuInstance, MigControl, MigError, Mode,
    Placement,
};

/// `NVML_STRUCT_VERSION(GpuInstanceProfileInfo, 2)`.
const GI_PROFILE_INFO_V2: c_uint =
    (std::mem::size_of::<nvmlGpuInstanceProfileInfo_v2_t>() as c_uint) | (2 << 24);

fn error(gpu: &str, call: &'static str, e: NvmlError) -> MigError {
    let kind = match &e {
        NvmlError::InUse => ErrorKind::InUse,
        NvmlError::NotSupported => ErrorKind::NotSupported,
        _ => ErrorKind::Other,
    };
    MigError {
        gpu: gpu.to_string(),
        call,
        message: e.to_string(),
        kind,
    }
}

fn check(gpu: &str, call: &'static str, rc: nvmlReturn_t) -> Result<(), MigError> {
    if rc == nvmlReturn_enum_NVML_ERROR_INSUFFICIENT_RESOURCES {
        // nvml-wrapper has no variant of its own for this one.
        return Err(MigError {
            gpu: gpu.to_string(),
            call,
            message: "NVML_ERROR_INSUFFICIENT_RESOURCES: the GPU has no room for it there".into(),
            kind: ErrorKind::Insufficient,
        });
    }
    nvml_try(rc).map_err(|e| error(gpu, call, e))
}

/// A symbol of the loaded library, or an error naming it.
fn sym<'a, F, E: std::fmt::Display>(
    f: &'a Result<F, E>,
    gpu: &str,
    call: &'static str,
) -> Result<&'a F, MigError> {
    f.as_ref().map_err(|e| MigError {
        gpu: gpu.to_string(),
        call,
        message: format!("the NVML library has no {call} ({e}); the driver is too old for MIG"),
        kind: ErrorKind::NotSupported,
    })
}

/// A profile index NVML does not offer on this GPU.
fn absent(rc: nvmlReturn_t) -> bool {
    rc == nvmlReturn_enum_NVML_ERROR_NOT_SUPPORTED
        || rc == nvmlReturn_enum_NVML_ERROR_INVALID_ARGUMENT
        || rc == nvmlReturn_enum_NVML_ERROR_NOT_FOUND
}

/// NVIDIA's suffix for a profile index's variant (media extensions, graphics).
fn variant(index: u32) -> &'static str {
    match index {
        7 | 8 => "+me",
        10..=12 => "+gfx",
        13 | 14 => "-me",
        15 | 16 => "+me.all",
        _ => "",
    }
}

impl NvmlBackend {
    fn device(&self, gpu: &str) -> Result<Device<'_>, MigError> {
        self.nvml
            .device_by_uuid(gpu)
            .map_err(|e| error(gpu, "nvmlDeviceGetHandleByUUID", e))
    }

    fn gpu_instance(&self, gpu: &str, id: u32) -> Result<nvmlGpuInstance_t, MigError> {
        let device = self.device(gpu)?;
        let lib = self.nvml.lib();
        let f = sym(
            &lib.nvmlDeviceGetGpuInstanceById,
            gpu,
            "nvmlDeviceGetGpuInstanceById",
        )?;
        let mut gi: nvmlGpuInstance_t = std::ptr::null_mut();
        // SAFETY: the device handle comes from this live NVML session; `gi`
        // is a valid out-pointer for the call.
        let rc = unsafe { f(device.handle(), id, &mut gi) };
        check(gpu, "nvmlDeviceGetGpuInstanceById", rc)?;
        Ok(gi)
    }

    fn gi_info(&self, gpu: &str, gi: nvmlGpuInstance_t) -> Result<nvmlGpuInstanceInfo_t, MigError> {
        let f = sym(
            &self.nvml.lib().nvmlGpuInstanceGetInfo,
            gpu,
            "nvmlGpuInstanceGetInfo",
        )?;
        // SAFETY: a zeroed struct of plain integers and a null pointer is a
        // valid value to be overwritten.
        let mut info: nvmlGpuInstanceInfo_t = unsafe { std::mem::zeroed() };
        // SAFETY: `gi` was returned by NVML in this session; `info` is a
        // valid out-pointer.
        let rc = unsafe { f(gi, &mut info) };
        check(gpu, "nvmlGpuInstanceGetInfo", rc)?;
        Ok(info)
    }

    fn ci_id(&self, gpu: &str, ci: nvmlComputeInstance_t) -> Result<(u32, u32), MigError> {
        let f = sym(
            &self.nvml.lib().nvmlComputeInstanceGetInfo_v2,
            gpu,
            "nvmlComputeInstanceGetInfo_v2",
        )?;
        // SAFETY: plain integers and null pointers; overwritten by NVML.
        let mut info: nvmlComputeInstanceInfo_t = unsafe { std::mem::zeroed() };
        // SAFETY: `ci` was returned by NVML in this session; `info` is a
        // valid out-pointer.
        let rc = unsafe { f(ci, &mut info) };
        check(gpu, "nvmlComputeInstanceGetInfo", rc)?;
        Ok((info.id, info.profileId))
    }

    /// The GPU's memory in MiB (to name profiles when NVML gives no name).
    fn memory_mib(&self, device: &Device<'_>) -> u64 {
        device.memory_info().map_or(0, |m| m.total / (1024 * 1024))
    }

    fn gi_profile(
        &self,
        gpu: &str,
        device: &Device<'_>,
        index: u32,
    ) -> Result<Option<GiProfile>, MigError> {
        let lib = self.nvml.lib();
        // NVIDIA's own name where the library has the v2 query.
        let (id, slices, instances, memory, name) =
            if let Ok(f) = lib.nvmlDeviceGetGpuInstanceProfileInfoV.as_ref() {
                // SAFETY: plain integers and a char array; overwritten by NVML.
                let mut info: nvmlGpuInstanceProfileInfo_v2_t = unsafe { std::mem::zeroed() };
                info.version = GI_PROFILE_INFO_V2;
                // SAFETY: the device handle is live; `info` is a valid
                // out-pointer of the version it says.
                let rc = unsafe { f(device.handle(), index, &mut info) };
                if absent(rc) {
                    return Ok(None);
                }
                check(gpu, "nvmlDeviceGetGpuInstanceProfileInfoV", rc)?;
                // SAFETY: NVML writes a NUL-terminated name into the 96-byte
                // array; the zeroed array ends in NUL regardless.
                let raw = unsafe { CStr::from_ptr(info.name.as_ptr()) };
                let name = raw.to_string_lossy();
                let name = name.trim().trim_start_matches("MIG ").to_string();
                (
                    info.id,
                    info.sliceCount,
                    info.instanceCount,
                    info.memorySizeMB,
                    (!name.is_empty()).then_some(name),
                )
            } else {
                let f = sym(
                    &lib.nvmlDeviceGetGpuInstanceProfileInfo,
                    gpu,
                    "nvmlDeviceGetGpuInstanceProfileInfo",
                )?;
                // SAFETY: plain integers; overwritten by NVML.
                let mut info: nvmlGpuInstanceProfileInfo_t = unsafe { std::mem::zeroed() };
                // SAFETY: the device handle is live; `info` is a valid out-pointer.
                let rc = unsafe { f(device.handle(), index, &mut info) };
                if absent(rc) {
                    return Ok(None);
                }
                check(gpu, "nvmlDeviceGetGpuInstanceProfileInfo", rc)?;
                (
                    info.id,
                    info.sliceCount,
                    info.instanceCount,
                    info.memorySizeMB,
                    None,
                )
            };
        let name = name.unwrap_or_else(|| {
            let gpu_mib = self.memory_mib(device);
            format!(
                "{}{}",
                mig_profile_name(slices, slices, memory, gpu_mib),
                variant(index)
            )
        });
        let f = sym(
            &lib.nvmlDeviceGetGpuInstancePossiblePlacements_v2,
            gpu,
            "nvmlDeviceGetGpuInstancePossiblePlacements_v2",
        )?;
        let mut count: c_uint = 0;
        // SAFETY: a null array asks for the count only, as NVML documents.
        let rc = unsafe { f(device.handle(), id, std::ptr::null_mut(), &mut count) };
        check(gpu, "nvmlDeviceGetGpuInstancePossiblePlacements", rc)?;
        let mut raw = vec![nvmlGpuInstancePlacement_t { start: 0, size: 0 }; count as usize];
        // SAFETY: `raw` has room for `count` placements, the count passed in.
        let rc = unsafe { f(device.handle(), id, raw.as_mut_ptr(), &mut count) };
        check(gpu, "nvmlDeviceGetGpuInstancePossiblePlacements", rc)?;
        raw.truncate(count as usize);
        Ok(Some(GiProfile {
            id,
            name,
            slices,
            instances,
            memory_mib: memory,
            placements: raw
                .iter()
                .map(|p| Placement {
                    start: p.start,
                    size: p.size,
                })
                .collect(),
        }))
    }

    fn ci_profiles_of(&self, gpu: &str, gi: nvmlGpuInstance_t) -> Result<Vec<CiProfile>, MigError> {
        let f = sym(
            &self.nvml.lib().nvmlGpuInstanceGetComputeInstanceProfileInfo,
            gpu,
            "nvmlGpuInstanceGetComputeInstanceProfileInfo",
        )?;
        let mut out = Vec::new();
        for index in 0..NVML_COMPUTE_INSTANCE_PROFILE_COUNT {
            // SAFETY: plain integers; overwritten by NVML.
            let mut info: nvmlComputeInstanceProfileInfo_t = unsafe { std::mem::zeroed() };
            // SAFETY: `gi` was returned by NVML in this session; `info` is a
            // valid out-pointer.
            let rc = unsafe {
                f(
                    gi,
                    index,
                    NVML_COMPUTE_INSTANCE_ENGINE_PROFILE_SHARED,
                    &mut info,
                )
            };
            if absent(rc) {
                continue;
            }
            check(gpu, "nvmlGpuInstanceGetComputeInstanceProfileInfo", rc)?;
            if !out.iter().any(|c: &CiProfile| c.id == info.id) {
                out.push(CiProfile {
                    id: info.id,
                    slices: info.sliceCount,
                });
            }
        }
        Ok(out)
    }
}

impl MigControl for NvmlBackend {
    fn mode(&self, gpu: &str) -> Result<Mode, MigError> {
        let m = self
            .device(gpu)?
            .mig_mode()
            .map_err(|e| error(gpu, "nvmlDeviceGetMigMode", e))?;
        Ok(Mode {
            current: m.current != 0,
            pending: m.pending != 0,
        })
    }

    fn set_mode(&self, gpu: &str, on: bool) -> Result<(), MigError> {
        let status = self
            .device(gpu)?
            .set_mig_mode(on)
            .map_err(|e| error(gpu, "nvmlDeviceSetMigMode", e))?;
        if status != nvmlReturn_enum_NVML_SUCCESS {
            tracing::info!(
                gpu,
                activation = status,
                "MIG mode set; it waits for a GPU reset"
            );
        }
        Ok(())
    }

    fn gi_profiles(&self, gpu: &str) -> Result<Vec<GiProfile>, MigError> {
        let device = self.device(gpu)?;
        let mut out: Vec<GiProfile> = Vec::new();
        for index in 0..NVML_GPU_INSTANCE_PROFILE_COUNT {
            if let Some(p) = self.gi_profile(gpu, &device, index)?
                && !out.iter().any(|o| o.id == p.id)
            {
                out.push(p);
            }
        }
        Ok(out)
    }

    fn ci_profiles(&self, gpu: &str, gi: u32) -> Result<Vec<CiProfile>, MigError> {
        let handle = self.gpu_instance(gpu, gi)?;
        self.ci_profiles_of(gpu, handle)
    }

    fn instances(&self, gpu: &str) -> Result<Vec<GpuInstance>, MigError> {
        let device = self.device(gpu)?;
        let lib = self.nvml.lib();
        let list = sym(
            &lib.nvmlDeviceGetGpuInstances,
            gpu,
            "nvmlDeviceGetGpuInstances",
        )?;
        let list_ci = sym(
            &lib.nvmlGpuInstanceGetComputeInstances,
            gpu,
            "nvmlGpuInstanceGetComputeInstances",
        )?;
        let mut out = Vec::new();
        for profile in self.gi_profiles(gpu)? {
            let mut handles: Vec<nvmlGpuInstance_t> =
                vec![std::ptr::null_mut(); profile.instances.max(1) as usize];
            let mut count: c_uint = 0;
            // SAFETY: `handles` has room for the profile's instance count,
            // the most NVML can return; `count` is a valid out-pointer.
            let rc = unsafe {
                list(
                    device.handle(),
                    profile.id,
                    handles.as_mut_ptr(),
                    &mut count,
                )
            };
            check(gpu, "nvmlDeviceGetGpuInstances", rc)?;
            handles.truncate(count as usize);
            for gi in handles {
                let info = self.gi_info(gpu, gi)?;
                let mut cis = Vec::new();
                for cp in self.ci_profiles_of(gpu, gi)? {
                    let mut ch: Vec<nvmlComputeInstance_t> = vec![std::ptr::null_mut(); 8];
                    let mut n: c_uint = 0;
                    // SAFETY: `ch` has room for 8 compute instances, more
                    // than a GPU instance can hold (at most 7 slices).
                    let rc = unsafe { list_ci(gi, cp.id, ch.as_mut_ptr(), &mut n) };
                    if absent(rc) {
                        continue;
                    }
                    check(gpu, "nvmlGpuInstanceGetComputeInstances", rc)?;
                    for ci in ch.into_iter().take(n as usize) {
                        let (id, profile_id) = self.ci_id(gpu, ci)?;
                        cis.push(ComputeInstance { id, profile_id });
                    }
                }
                cis.sort_by_key(|c| c.id);
                out.push(GpuInstance {
                    id: info.id,
                    profile_id: info.profileId,
                    placement: (info.placement.start, info.placement.size),
                    cis,
                });
            }
        }
        out.sort_by_key(|g| g.id);
        Ok(out)
    }

    fn create_gi(&self, gpu: &str, profile_id: u32, at: Placement) -> Result<u32, MigError> {
        let device = self.device(gpu)?;
        let f = sym(
            &self.nvml.lib().nvmlDeviceCreateGpuInstanceWithPlacement,
            gpu,
            "nvmlDeviceCreateGpuInstanceWithPlacement",
        )?;
        let placement = nvmlGpuInstancePlacement_t {
            start: at.start,
            size: at.size,
        };
        let mut gi: nvmlGpuInstance_t = std::ptr::null_mut();
        // SAFETY: the device handle is live; `placement` outlives the call
        // and `gi` is a valid out-pointer.
        let rc = unsafe { f(device.handle(), profile_id, &placement, &mut gi) };
        check(gpu, "nvmlDeviceCreateGpuInstanceWithPlacement", rc)?;
        Ok(self.gi_info(gpu, gi)?.id)
    }

    fn create_ci(&self, gpu: &str, gi: u32, profile_id: u32) -> Result<u32, MigError> {
        let handle = self.gpu_instance(gpu, gi)?;
        let f = sym(
            &self.nvml.lib().nvmlGpuInstanceCreateComputeInstance,
            gpu,
            "nvmlGpuInstanceCreateComputeInstance",
        )?;
        let mut ci: nvmlComputeInstance_t = std::ptr::null_mut();
        // SAFETY: `handle` was returned by NVML in this session; `ci` is a
        // valid out-pointer.
        let rc = unsafe { f(handle, profile_id, &mut ci) };
        check(gpu, "nvmlGpuInstanceCreateComputeInstance", rc)?;
        Ok(self.ci_id(gpu, ci)?.0)
    }

    fn destroy_ci(&self, gpu: &str, gi: u32, ci: u32) -> Result<(), MigError> {
        let handle = self.gpu_instance(gpu, gi)?;
        let lib = self.nvml.lib();
        let by_id = sym(
            &lib.nvmlGpuInstanceGetComputeInstanceById,
            gpu,
            "nvmlGpuInstanceGetComputeInstanceById",
        )?;
        let destroy = sym(
            &lib.nvmlComputeInstanceDestroy,
            gpu,
            "nvmlComputeInstanceDestroy",
        )?;
        let mut ch: nvmlComputeInstance_t = std::ptr::null_mut();
        // SAFETY: `handle` is live; `ch` is a valid out-pointer.
        let rc = unsafe { by_id(handle, ci, &mut ch) };
        check(gpu, "nvmlGpuInstanceGetComputeInstanceById", rc)?;
        // SAFETY: `ch` was just returned by NVML and is not used afterwards.
        let rc = unsafe { destroy(ch) };
        check(gpu, "nvmlComputeInstanceDestroy", rc)
    }

    fn destroy_gi(&self, gpu: &str, gi: u32) -> Result<(), MigError> {
        let handle = self.gpu_instance(gpu, gi)?;
        let f = sym(
            &self.nvml.lib().nvmlGpuInstanceDestroy,
            gpu,
            "nvmlGpuInstanceDestroy",
        )?;
        // SAFETY: `handle` was just returned by NVML and is not used afterwards.
        let rc = unsafe { f(handle) };
        check(gpu, "nvmlGpuInstanceDestroy", rc)
    }

    fn processes(&self, gpu: &str) -> Result<Vec<u32>, MigError> {
        match self.device(gpu)?.running_compute_processes() {
            Ok(p) => Ok(p.into_iter().map(|p| p.pid).collect()),
            Err(NvmlError::NotSupported) | Err(NvmlError::FailedToLoadSymbol(_)) => Ok(Vec::new()),
            Err(e) => Err(error(gpu, "nvmlDeviceGetComputeRunningProcesses", e)),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use nvml_wrapper_sys::bindings::nvmlReturn_enum_NVML_ERROR_IN_USE;

    #[test]
    fn the_v2_struct_version_is_nvmls() {
        // sizeof(nvmlGpuInstanceProfileInfo_v2_t) is 148 bytes (11 uints,
        // padding to 8, one u64 and a 96-byte name), version 2 in the top byte.
        assert_eq!(GI_PROFILE_INFO_V2 >> 24, 2);
        assert_eq!(
            GI_PROFILE_INFO_V2 & 0xff_ffff,
            std::mem::size_of::<nvmlGpuInstanceProfileInfo_v2_t>() as u32
        );
        assert_eq!(variant(7), "+me");
        assert_eq!(variant(0), "");
    }

    #[test]
    fn in_use_and_insufficient_resources_are_told_apart() {
        let e = error(
            "GPU-1",
            "x",
            nvml_try(nvmlReturn_enum_NVML_ERROR_IN_USE).unwrap_err(),
        );
        assert_eq!(e.kind, ErrorKind::InUse);
        let e = check(
            "GPU-1",
            "x",
            nvmlReturn_enum_NVML_ERROR_INSUFFICIENT_RESOURCES,
        )
        .unwrap_err();
        assert_eq!(e.kind, ErrorKind::Insufficient);
        assert!(check("GPU-1", "x", nvmlReturn_enum_NVML_SUCCESS).is_ok());
    }
}
