//! The real backend: NVML through `nvml-wrapper`.
//!
//! On a GPU node this talks to the driver. In CI it is loaded against the
//! project's fake `libnvidia-ml.so.1` (tests/fake-nvml), the same code path.

use std::ffi::OsStr;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use hostlib::PciAddress;
use nvml_wrapper::Nvml;
use nvml_wrapper::bitmasks::event::EventTypes;
use nvml_wrapper::enum_wrappers::device::{
    ComputeMode as NvmlComputeMode, TemperatureSensor, TemperatureThreshold, TopologyLevel,
};
use nvml_wrapper::enums::event::XidError;
use nvml_wrapper::error::NvmlError;

use super::{
    BackendError, BackendGpu, BackendSnapshot, ComputeCapability, ComputeMode, CudaVersion,
    GpuBackend, GpuFabric, HealthEvent, HealthSender, MigDevice, MigEngines, MigMode, PcieLevel,
    Telemetry, mig_profile_name,
};

/// How long one wait for events blocks. Events wake the thread at once; the
/// timeout only lets it notice that nobody listens any more, which happens
/// when the agent stops (the thread then ends with the process), so it is
/// long: an idle agent wakes for it once a minute.
const EVENT_WAIT_MS: u32 = 60_000;
/// Between tries while the event wait fails.
const RETRY_MS: u32 = 1_000;

/// The library name the dynamic loader looks for.
pub const DEFAULT_LIB: &str = "libnvidia-ml.so.1";

/// `NVML_NVLINK_MAX_LINKS`: link numbers run from 0 to 17.
const NVLINK_MAX_LINKS: u32 = 18;

/// NVML, initialised once and shut down on drop (after the event thread,
/// which holds a reference, is gone).
pub struct NvmlBackend {
    pub(super) nvml: Arc<Nvml>,
    lib: PathBuf,
}

impl std::fmt::Debug for NvmlBackend {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("NvmlBackend")
            .field("lib", &self.lib)
            .finish()
    }
}

impl NvmlBackend {
    /// Loads NVML from `lib` (a path, or a name the dynamic loader finds) and
    /// initialises it.
    pub fn open(lib: Option<&Path>) -> Result<Self, BackendError> {
        let lib = lib.map_or_else(|| PathBuf::from(DEFAULT_LIB), Path::to_path_buf);
        let nvml = Nvml::builder()
            .lib_path(OsStr::new(lib.as_os_str()))
            .init()
            .map_err(|e| match e {
                NvmlError::LibloadingError(inner) => BackendError::Library {
                    lib: lib.display().to_string(),
                    message: inner.to_string(),
                },
                NvmlError::DriverNotLoaded => BackendError::DriverNotLoaded(e.to_string()),
                other => BackendError::Nvml {
                    call: "nvmlInit",
                    source: other.into(),
                },
            })?;
        tracing::debug!(lib = %lib.display(), "NVML initialised");
        Ok(NvmlBackend {
            nvml: Arc::new(nvml),
            lib,
        })
    }
}

fn nvml_compute_mode(mode: ComputeMode) -> NvmlComputeMode {
    match mode {
        ComputeMode::Default => NvmlComputeMode::Default,
        ComputeMode::ExclusiveThread => NvmlComputeMode::ExclusiveThread,
        ComputeMode::Prohibited => NvmlComputeMode::Prohibited,
        ComputeMode::ExclusiveProcess => NvmlComputeMode::ExclusiveProcess,
    }
}

fn pcie_level(level: TopologyLevel) -> PcieLevel {
    match level {
        TopologyLevel::Internal => PcieLevel::SameBoard,
        TopologyLevel::Single => PcieLevel::SingleSwitch,
        TopologyLevel::Multiple => PcieLevel::MultiSwitch,
        TopologyLevel::HostBridge => PcieLevel::HostBridge,
        TopologyLevel::Node => PcieLevel::SameNuma,
        TopologyLevel::System => PcieLevel::CrossNuma,
    }
}

/// `Ok(None)` for answers NVML does not support on this GPU.
pub(super) fn optional<T>(r: Result<T, NvmlError>) -> Result<Option<T>, NvmlError> {
    match r {
        Ok(v) => Ok(Some(v)),
        Err(NvmlError::NotSupported) => Ok(None),
        Err(e) => Err(e),
    }
}

/// Readings are best-effort: an error other than "not supported" is logged
/// and the reading left out, so one flaky sensor does not hide a GPU.
pub(super) fn reading<T>(index: u32, what: &'static str, r: Result<T, NvmlError>) -> Option<T> {
    match optional(r) {
        Ok(v) => v,
        Err(e) => {
            tracing::warn!(gpu = index, reading = what, error = %e, "NVML reading failed");
            None
        }
    }
}

pub(super) type InstanceIdFn = unsafe extern "C" fn(
    nvml_wrapper_sys::bindings::nvmlDevice_t,
    *mut std::ffi::c_uint,
) -> nvml_wrapper_sys::bindings::nvmlReturn_t;

/// A MIG device's GPU-instance or compute-instance ID
/// (`nvmlDeviceGetGpuInstanceId` / `nvmlDeviceGetComputeInstanceId`), which
/// nvml-wrapper 0.13 does not wrap: they name the `/dev/nvidia-caps` nodes a
/// container needs. `None` when the library lacks the symbol or the call fails.
#[allow(unsafe_code)]
pub(super) fn instance_id<E>(
    f: &Result<InstanceIdFn, E>,
    mig: &nvml_wrapper::Device<'_>,
) -> Option<u32> {
    let f = f.as_ref().ok()?;
    let mut id: std::ffi::c_uint = 0;
    // SAFETY: the handle belongs to `mig`, which borrows the live NVML
    // session the function pointer was loaded from; `id` is a valid
    // out-pointer for the duration of the call.
    let rc = unsafe { f(mig.handle(), &mut id) };
    (rc == nvml_wrapper_sys::bindings::nvmlReturn_enum_NVML_SUCCESS).then_some(id)
}

pub(super) type GpuInstanceByIdFn =
    unsafe extern "C" fn(
        nvml_wrapper_sys::bindings::nvmlDevice_t,
        std::ffi::c_uint,
        *mut nvml_wrapper_sys::bindings::nvmlGpuInstance_t,
    ) -> nvml_wrapper_sys::bindings::nvmlReturn_t;

pub(super) type GpuInstanceInfoFn =
    unsafe extern "C" fn(
        nvml_wrapper_sys::bindings::nvmlGpuInstance_t,
        *mut nvml_wrapper_sys::bindings::nvmlGpuInstanceInfo_t,
    ) -> nvml_wrapper_sys::bindings::nvmlReturn_t;

/// Where a MIG device's GPU instance sits: its profile ID and its
/// placement's start (`nvmlDeviceGetGpuInstanceById` on the parent GPU with
/// the device's GPU-instance ID, then `nvmlGpuInstanceGetInfo`), which
/// nvml-wrapper 0.13 does not wrap. `Err` names the call that failed (or
/// that the library lacks).
///
/// # Safety
/// `parent` must be a GPU handle of the live NVML session both functions
/// were loaded from.
#[allow(unsafe_code)]
pub(super) unsafe fn gpu_instance_placement<E: std::fmt::Display>(
    by_id: &Result<GpuInstanceByIdFn, E>,
    get_info: &Result<GpuInstanceInfoFn, E>,
    parent: nvml_wrapper_sys::bindings::nvmlDevice_t,
    gi_id: u32,
) -> Result<(u32, u32), (&'static str, String)> {
    const BY_ID: &str = "nvmlDeviceGetGpuInstanceById";
    const INFO: &str = "nvmlGpuInstanceGetInfo";
    let by_id = by_id
        .as_ref()
        .map_err(|e| (BY_ID, format!("not in the NVML library: {e}")))?;
    let get_info = get_info
        .as_ref()
        .map_err(|e| (INFO, format!("not in the NVML library: {e}")))?;
    let mut gi: nvml_wrapper_sys::bindings::nvmlGpuInstance_t = std::ptr::null_mut();
    // SAFETY: `parent` is a handle of the session `by_id` was loaded from
    // (the caller's promise); `gi` is a valid out-pointer for the call.
    let rc = unsafe { by_id(parent, gi_id, &mut gi) };
    nvml_wrapper::error::nvml_try(rc).map_err(|e| (BY_ID, e.to_string()))?;
    // SAFETY: a struct of plain integers and a null pointer, all zero, is a
    // valid value to be overwritten.
    let mut info: nvml_wrapper_sys::bindings::nvmlGpuInstanceInfo_t = unsafe { std::mem::zeroed() };
    // SAFETY: `gi` was just returned by NVML in this session; `info` is a
    // valid out-pointer for the call.
    let rc = unsafe { get_info(gi, &mut info) };
    nvml_wrapper::error::nvml_try(rc).map_err(|e| (INFO, e.to_string()))?;
    Ok((info.profileId, info.placement.start))
}

pub(super) type RemappedRowsFn = unsafe extern "C" fn(
    nvml_wrapper_sys::bindings::nvmlDevice_t,
    *mut std::ffi::c_uint,
    *mut std::ffi::c_uint,
    *mut std::ffi::c_uint,
    *mut std::ffi::c_uint,
) -> nvml_wrapper_sys::bindings::nvmlReturn_t;

/// `nvmlDeviceGetRemappedRows`'s answer.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) struct RemappedRows {
    pub correctable: u32,
    pub uncorrectable: u32,
    /// Remapped rows wait for a GPU reset.
    pub pending: bool,
    /// A remap failed.
    pub failure: bool,
}

/// Remapped rows (`nvmlDeviceGetRemappedRows`), which nvml-wrapper 0.13 does
/// not wrap. `None` when the library lacks the symbol or the GPU does not
/// remap rows (pre-Ampere).
#[allow(unsafe_code)]
pub(super) fn remapped_rows<E>(
    f: &Result<RemappedRowsFn, E>,
    device: &nvml_wrapper::Device<'_>,
) -> Option<RemappedRows> {
    let f = f.as_ref().ok()?;
    let (mut corr, mut unc, mut pending, mut failure): (
        std::ffi::c_uint,
        std::ffi::c_uint,
        std::ffi::c_uint,
        std::ffi::c_uint,
    ) = (0, 0, 0, 0);
    // SAFETY: the handle belongs to `device`, which borrows the live NVML
    // session the function pointer was loaded from; the four out-pointers
    // are valid for the duration of the call.
    let rc = unsafe {
        f(
            device.handle(),
            &mut corr,
            &mut unc,
            &mut pending,
            &mut failure,
        )
    };
    (rc == nvml_wrapper_sys::bindings::nvmlReturn_enum_NVML_SUCCESS).then_some(RemappedRows {
        correctable: corr,
        uncorrectable: unc,
        pending: pending != 0,
        failure: failure != 0,
    })
}

/// `NVML_STRUCT_VERSION(GpuFabricInfo, n)`: the struct's size with the
/// version in the top byte.
const fn fabric_info_version(size: usize, version: u32) -> u32 {
    size as u32 | (version << 24)
}

/// The GPU's fabric registration (`nvmlDeviceGetGpuFabricInfoV`, which
/// nvml-wrapper 0.13 does not wrap, called through nvml-wrapper-sys):
/// version 3 of the struct, else 2 for a library that does not know 3, else
/// the unversioned `nvmlDeviceGetGpuFabricInfo` of older libraries. `None`
/// when the GPU has no fabric (not supported, as every PCIe GPU), the
/// library has neither call, or the call fails (logged).
#[allow(unsafe_code)]
fn fabric_info(
    nvml: &Nvml,
    device: &nvml_wrapper::Device<'_>,
    notes: &mut Vec<String>,
) -> Option<GpuFabric> {
    use nvml_wrapper_sys::bindings::{
        nvmlGpuFabricInfo_t, nvmlGpuFabricInfo_v2_t, nvmlGpuFabricInfo_v3_t,
        nvmlReturn_enum_NVML_ERROR_ARGUMENT_VERSION_MISMATCH as VERSION_MISMATCH,
        nvmlReturn_enum_NVML_ERROR_NOT_SUPPORTED as NOT_SUPPORTED,
        nvmlReturn_enum_NVML_SUCCESS as SUCCESS,
    };
    let lib = nvml.lib();
    let (rc, fields) = if let Ok(f) = lib.nvmlDeviceGetGpuFabricInfoV.as_ref() {
        let mut answer = (VERSION_MISMATCH, None);
        for version in [
            fabric_info_version(size_of::<nvmlGpuFabricInfo_v3_t>(), 3),
            fabric_info_version(size_of::<nvmlGpuFabricInfo_v2_t>(), 2),
        ] {
            // SAFETY: plain integers and byte arrays; all-zero is valid.
            let mut info: nvmlGpuFabricInfo_v3_t = unsafe { std::mem::zeroed() };
            info.version = version;
            // SAFETY: the handle belongs to `device`, which borrows the live
            // NVML session the function was loaded from; `info` is a v3
            // struct, as large as any version the call may fill.
            let rc = unsafe { f(device.handle(), &mut info) };
            answer = (
                rc,
                Some((info.clusterUuid, info.status, info.cliqueId, info.state)),
            );
            if rc != VERSION_MISMATCH {
                break;
            }
        }
        answer
    } else if let Ok(f) = lib.nvmlDeviceGetGpuFabricInfo.as_ref() {
        // SAFETY: plain integers and a byte array; all-zero is valid.
        let mut info: nvmlGpuFabricInfo_t = unsafe { std::mem::zeroed() };
        // SAFETY: as above; `info` is the struct the call takes.
        let rc = unsafe { f(device.handle(), &mut info) };
        (
            rc,
            Some((info.clusterUuid, info.status, info.cliqueId, info.state)),
        )
    } else {
        return None;
    };
    match (rc, fields) {
        (SUCCESS, Some((uuid, status, clique, state))) => {
            GpuFabric::from_nvml(uuid, status, clique, state)
        }
        (NOT_SUPPORTED, _) => None,
        (rc, _) => {
            notes.push(format!(
                "NVML's fabric info query failed (return code {rc}); the GPU is taken as not on a fabric"
            ));
            None
        }
    }
}

/// A MIG device's GPU-instance profile ID and placement start, from its
/// parent GPU `device` and its GPU-instance ID `gi`; `None` (said in
/// `notes`) when NVML cannot say: one missing fact never hides the device.
#[allow(unsafe_code)]
fn mig_placement(
    nvml: &Nvml,
    device: &nvml_wrapper::Device<'_>,
    mig_uuid: &str,
    gi: u32,
    notes: &mut Vec<String>,
) -> Option<(u32, u32)> {
    let lib = nvml.lib();
    // SAFETY: `device`'s handle belongs to `nvml`, the session the
    // library's functions were loaded from, and lives as long as `device`.
    let found = unsafe {
        gpu_instance_placement(
            &lib.nvmlDeviceGetGpuInstanceById,
            &lib.nvmlGpuInstanceGetInfo,
            device.handle(),
            gi,
        )
    };
    match found {
        Ok(p) => Some(p),
        Err((call, error)) => {
            notes.push(format!(
                "NVML did not say where MIG device {mig_uuid}'s GPU instance {gi} is placed ({call}: {error}): its profile ID and placement start are left out"
            ));
            None
        }
    }
}

/// One GPU as NVML describes it (and its handle, for the topology).
fn describe_device(
    nvml: &Nvml,
    index: u32,
) -> Result<(nvml_wrapper::Device<'_>, BackendGpu), BackendError> {
    let dev_err = |call: &'static str| {
        move |source: NvmlError| BackendError::Device {
            index,
            call,
            source: source.into(),
        }
    };
    let device = nvml
        .device_by_index(index)
        .map_err(dev_err("nvmlDeviceGetHandleByIndex"))?;
    let pci = device.pci_info().map_err(dev_err("nvmlDeviceGetPciInfo"))?;
    let bus_id: PciAddress = pci.bus_id.parse().map_err(|_| BackendError::Device {
        index,
        call: "nvmlDeviceGetPciInfo",
        source: NvmlError::Unknown.into(),
    })?;
    let memory = optional(device.memory_info()).map_err(dev_err("nvmlDeviceGetMemoryInfo"))?;
    let mig = optional(device.mig_mode())
        .map_err(dev_err("nvmlDeviceGetMigMode"))?
        .map(|m| MigMode {
            current: m.current == 1,
            pending: m.pending == 1,
        });
    let mut notes = Vec::new();
    let mut nvlink_remotes = Vec::new();
    for link in 0..NVLINK_MAX_LINKS {
        let l = device.link_wrapper_for(link);
        match l.is_active() {
            Ok(true) => {}
            Ok(false) => continue,
            // No NVLink on this GPU, or no link with this number.
            Err(NvmlError::NotSupported | NvmlError::InvalidArg) => break,
            Err(e) => return Err(dev_err("nvmlDeviceGetNvLinkState")(e)),
        }
        let remote = l
            .remote_pci_info()
            .map_err(dev_err("nvmlDeviceGetNvLinkRemotePciInfo"))?;
        match remote.bus_id.parse() {
            Ok(addr) => nvlink_remotes.push(addr),
            Err(_) => notes.push(format!(
                "NVLink {link}'s remote {:?} is not a PCI address; the link is left out",
                remote.bus_id
            )),
        }
    }
    let util = reading(index, "utilization", device.utilization_rates());
    let memory_total_mib = memory.as_ref().map(|m| m.total / (1024 * 1024));
    let mut mig_devices = Vec::new();
    if mig.is_some_and(|m| m.current) {
        let slots = device
            .mig_device_count()
            .map_err(dev_err("nvmlDeviceGetMaxMigDeviceCount"))?;
        for slot in 0..slots {
            let m = match device.mig_device_by_index(slot) {
                Ok(m) => m,
                // An empty slot.
                Err(NvmlError::NotFound) => continue,
                Err(e) => return Err(dev_err("nvmlDeviceGetMigDeviceHandleByIndex")(e)),
            };
            let uuid = m.uuid().map_err(dev_err("nvmlDeviceGetUUID (MIG)"))?;
            let a = m
                .attributes()
                .map_err(dev_err("nvmlDeviceGetAttributes (MIG)"))?;
            let gpu_instance_id = instance_id(&nvml.lib().nvmlDeviceGetGpuInstanceId, &m);
            let placement =
                gpu_instance_id.and_then(|gi| mig_placement(nvml, &device, &uuid, gi, &mut notes));
            mig_devices.push(MigDevice {
                index: slot,
                uuid,
                profile: mig_profile_name(
                    a.gpu_instance_slice_count,
                    a.compute_instance_slice_count,
                    a.memory_size_mb,
                    memory_total_mib.unwrap_or(0),
                ),
                gi_slices: a.gpu_instance_slice_count,
                ci_slices: a.compute_instance_slice_count,
                memory_mib: a.memory_size_mb,
                multiprocessors: a.multiprocessor_count,
                gpu_instance_id,
                compute_instance_id: instance_id(&nvml.lib().nvmlDeviceGetComputeInstanceId, &m),
                gi_profile_id: placement.map(|(profile, _)| profile),
                placement_start: placement.map(|(_, start)| start),
                engines: MigEngines {
                    copy: a.shared_copy_engine_count,
                    decoder: a.shared_decoder_count,
                    encoder: a.shared_encoder_count,
                    jpeg: a.shared_jpeg_count,
                    ofa: a.shared_ofa_count,
                },
            });
        }
    }
    let (brand, architecture) = super::nvml_identity::brand_and_architecture(&device, &mut notes);
    let gpu = BackendGpu {
        index,
        uuid: device.uuid().map_err(dev_err("nvmlDeviceGetUUID"))?,
        name: device.name().map_err(dev_err("nvmlDeviceGetName"))?,
        bus_id,
        memory_total_mib,
        compute_capability: optional(device.cuda_compute_capability())
            .map_err(dev_err("nvmlDeviceGetCudaComputeCapability"))?
            .map(|c| ComputeCapability {
                major: c.major as u32,
                minor: c.minor as u32,
            }),
        mig,
        nvlink_remotes,
        telemetry: Telemetry {
            temperature_c: reading(
                index,
                "temperature",
                device.temperature(TemperatureSensor::Gpu),
            ),
            power_mw: reading(index, "power", device.power_usage()),
            utilization_gpu_pct: util.as_ref().map(|u| u.gpu),
            utilization_memory_pct: util.as_ref().map(|u| u.memory),
            memory_used_mib: memory.as_ref().map(|m| m.used / (1024 * 1024)),
            // Health conditions: quietly absent where NVML has no answer.
            slowdown_temperature_c: device
                .temperature_threshold(TemperatureThreshold::Slowdown)
                .ok(),
            retired_pages_pending: device.are_pages_pending_retired().ok(),
            remapped_rows_pending: remapped_rows(&nvml.lib().nvmlDeviceGetRemappedRows, &device)
                .map(|r| r.pending),
        },
        mig_devices,
        fabric: fabric_info(nvml, &device, &mut notes),
        brand,
        architecture,
        notes,
    };
    Ok((device, gpu))
}

/// The event thread: registers every GPU for XID and double-bit ECC events
/// and forwards them until the receiver is gone.
fn watch_events(nvml: &Nvml, events: &HealthSender) -> Result<(), NvmlError> {
    let mut set = nvml.create_event_set()?;
    let wanted = EventTypes::CRITICAL_XID_ERROR | EventTypes::DOUBLE_BIT_ECC_ERROR;
    for index in 0..nvml.device_count()? {
        let device = nvml.device_by_index(index)?;
        let supported = match device.supported_event_types() {
            Ok(s) => s,
            Err(NvmlError::NotSupported) => EventTypes::empty(),
            Err(e) => return Err(e),
        };
        let types = wanted & supported;
        if types.is_empty() {
            tracing::warn!(
                gpu = index,
                "GPU reports no XID/ECC events; its health cannot be watched"
            );
            continue;
        }
        set = device.register_events(types, set).map_err(|e| e.error)?;
    }
    let mut failing = false;
    while !events.is_closed() {
        // While failing, look again every second so that recovery is seen soon.
        let timeout = if failing { RETRY_MS } else { EVENT_WAIT_MS };
        match set.wait(timeout) {
            Ok(ev) => {
                if std::mem::take(&mut failing) {
                    let _ = events.send(HealthEvent::Answering);
                }
                let uuid = match ev.device.uuid() {
                    Ok(u) => u,
                    Err(e) => {
                        // NVIDIA's plugin marks every GPU unhealthy here: we cannot tell which.
                        let _ = events.send(HealthEvent::WaitFailed(format!(
                            "event for an unidentifiable GPU: {e}"
                        )));
                        failing = true;
                        continue;
                    }
                };
                if ev.event_type.contains(EventTypes::CRITICAL_XID_ERROR) {
                    let xid = match ev.event_data {
                        Some(XidError::Value(v)) => v,
                        _ => 999,
                    };
                    let _ = events.send(HealthEvent::Xid { uuid, xid });
                } else if ev.event_type.contains(EventTypes::DOUBLE_BIT_ECC_ERROR) {
                    let _ = events.send(HealthEvent::DoubleBitEcc { uuid });
                }
            }
            Err(NvmlError::Timeout) => {
                if std::mem::take(&mut failing) {
                    let _ = events.send(HealthEvent::Answering);
                }
            }
            Err(e) => {
                if !failing {
                    let _ = events.send(HealthEvent::WaitFailed(format!("NVML event wait: {e}")));
                }
                failing = true;
                std::thread::sleep(Duration::from_millis(u64::from(RETRY_MS)));
            }
        }
    }
    Ok(())
}

impl GpuBackend for NvmlBackend {
    fn name(&self) -> &'static str {
        "nvml"
    }

    fn mig_control(&self) -> Option<&dyn gpu_model::mig::MigControl> {
        Some(self)
    }

    fn sampler(&self) -> Result<Box<dyn super::Sampler>, BackendError> {
        Ok(Box::new(self.nvml_sampler()))
    }

    fn watch_health(&self, events: HealthSender) -> Result<(), BackendError> {
        let nvml = self.nvml.clone();
        std::thread::Builder::new()
            .name("nvml-events".into())
            .spawn(move || {
                if let Err(e) = watch_events(&nvml, &events) {
                    tracing::error!(stage = "health", error = %e, "cannot watch NVML events");
                    let _ = events.send(HealthEvent::WaitFailed(format!(
                        "cannot watch NVML events: {e}"
                    )));
                }
            })
            .map_err(|e| {
                BackendError::Unavailable(format!("cannot start the NVML event thread: {e}"))
            })?;
        Ok(())
    }

    fn set_compute_mode(&self, uuid: &str, mode: ComputeMode) -> Result<(), BackendError> {
        let err = |call| {
            let uuid = uuid.to_string();
            move |source: NvmlError| BackendError::Gpu {
                uuid,
                call,
                source: source.into(),
            }
        };
        let mut device = self
            .nvml
            .device_by_uuid(uuid)
            .map_err(err("nvmlDeviceGetHandleByUUID"))?;
        device
            .set_compute_mode(nvml_compute_mode(mode))
            .map_err(err("nvmlDeviceSetComputeMode"))?;
        tracing::info!(gpu_uuid = %uuid, mode = %mode, "compute mode set");
        Ok(())
    }

    fn compute_mode(&self, uuid: &str) -> Result<ComputeMode, BackendError> {
        let err = |call| {
            let uuid = uuid.to_string();
            move |source: NvmlError| BackendError::Gpu {
                uuid,
                call,
                source: source.into(),
            }
        };
        let device = self
            .nvml
            .device_by_uuid(uuid)
            .map_err(err("nvmlDeviceGetHandleByUUID"))?;
        let mode = device
            .compute_mode()
            .map_err(err("nvmlDeviceGetComputeMode"))?;
        Ok(match mode {
            NvmlComputeMode::Default => ComputeMode::Default,
            NvmlComputeMode::ExclusiveThread => ComputeMode::ExclusiveThread,
            NvmlComputeMode::Prohibited => ComputeMode::Prohibited,
            NvmlComputeMode::ExclusiveProcess => ComputeMode::ExclusiveProcess,
        })
    }

    fn snapshot(&self) -> Result<BackendSnapshot, BackendError> {
        let nvml = &self.nvml;
        let sys = |call: &'static str| {
            move |source: NvmlError| BackendError::Nvml {
                call,
                source: source.into(),
            }
        };
        let driver_version =
            optional(nvml.sys_driver_version()).map_err(sys("nvmlSystemGetDriverVersion"))?;
        let cuda_version = optional(nvml.sys_cuda_driver_version())
            .map_err(sys("nvmlSystemGetCudaDriverVersion"))?
            .and_then(CudaVersion::from_nvml);
        let count = nvml.device_count().map_err(sys("nvmlDeviceGetCount"))?;
        let mut devices = Vec::with_capacity(count as usize);
        let mut gpus = Vec::with_capacity(count as usize);
        let mut lost = Vec::new();
        for index in 0..count {
            match describe_device(nvml, index) {
                Ok((device, gpu)) => {
                    gpus.push(gpu);
                    devices.push(device);
                }
                // One GPU gone (fallen off the bus): the others are still
                // described, and health hears of it.
                Err(BackendError::Device { source, .. })
                    if matches!(source.downcast_ref(), Some(NvmlError::GpuLost)) =>
                {
                    tracing::error!(gpu = index, "NVML has lost this GPU");
                    lost.push(index);
                }
                Err(e) => return Err(e),
            }
        }
        let mut pcie = Vec::new();
        for a in 0..devices.len() {
            for b in (a + 1)..devices.len() {
                // The wrapper takes the other device by value: ask for a second handle.
                let (ia, ib) = (gpus[a].index, gpus[b].index);
                let other = match nvml.device_by_index(ib) {
                    Ok(d) => d,
                    Err(e) => {
                        return Err(BackendError::Device {
                            index: ib,
                            call: "nvmlDeviceGetHandleByIndex",
                            source: e.into(),
                        });
                    }
                };
                match devices[a].topology_common_ancestor(other) {
                    Ok(level) => pcie.push((ia, ib, pcie_level(level))),
                    Err(NvmlError::NotSupported) => {}
                    Err(e) => {
                        tracing::warn!(gpu_a = a, gpu_b = b, error = %e, "NVML topology query failed")
                    }
                }
            }
        }
        Ok(BackendSnapshot {
            driver_version,
            cuda_version,
            gpus,
            lost,
            pcie,
        })
    }
}

#[cfg(test)]
#[allow(unsafe_code)]
mod tests {
    use super::*;
    use nvml_wrapper_sys::bindings::{
        nvmlDevice_t, nvmlGpuInstance_t, nvmlGpuInstanceInfo_t,
        nvmlReturn_enum_NVML_ERROR_NOT_FOUND, nvmlReturn_enum_NVML_ERROR_UNKNOWN,
        nvmlReturn_enum_NVML_SUCCESS, nvmlReturn_t,
    };

    /// GPU instances 0..=6 exist; the handle carries the ID plus one.
    unsafe extern "C" fn by_id(
        _device: nvmlDevice_t,
        id: std::ffi::c_uint,
        gi: *mut nvmlGpuInstance_t,
    ) -> nvmlReturn_t {
        if id > 6 {
            return nvmlReturn_enum_NVML_ERROR_NOT_FOUND;
        }
        // SAFETY: the caller's out-pointer.
        unsafe { *gi = (id as usize + 1) as nvmlGpuInstance_t };
        nvmlReturn_enum_NVML_SUCCESS
    }

    /// GPU instance `n` is a 1g.10gb (profile ID 19) at slice `6 - n`;
    /// instance 5's info cannot be read.
    unsafe extern "C" fn info(
        gi: nvmlGpuInstance_t,
        out: *mut nvmlGpuInstanceInfo_t,
    ) -> nvmlReturn_t {
        let id = gi as usize as u32 - 1;
        if id == 5 {
            return nvmlReturn_enum_NVML_ERROR_UNKNOWN;
        }
        // SAFETY: the caller's out-pointer, to a valid struct.
        let out = unsafe { &mut *out };
        out.id = id;
        out.profileId = 19;
        out.placement.start = 6 - id;
        out.placement.size = 1;
        nvmlReturn_enum_NVML_SUCCESS
    }

    fn placement(
        by: Result<GpuInstanceByIdFn, &str>,
        get: Result<GpuInstanceInfoFn, &str>,
        gi: u32,
    ) -> Result<(u32, u32), (&'static str, String)> {
        // SAFETY: the stand-ins ignore the parent handle.
        unsafe { gpu_instance_placement(&by, &get, std::ptr::null_mut(), gi) }
    }

    #[test]
    fn a_gpu_instance_is_found_by_id_and_its_profile_and_start_read() {
        assert_eq!(placement(Ok(by_id), Ok(info), 0), Ok((19, 6)));
        assert_eq!(placement(Ok(by_id), Ok(info), 2), Ok((19, 4)));
    }

    #[test]
    fn a_failing_or_missing_call_is_named() {
        let (call, why) = placement(Ok(by_id), Ok(info), 9).unwrap_err();
        assert_eq!(call, "nvmlDeviceGetGpuInstanceById");
        assert!(why.contains("unsuccessful"), "{why}");
        let (call, _) = placement(Ok(by_id), Ok(info), 5).unwrap_err();
        assert_eq!(call, "nvmlGpuInstanceGetInfo");
        let (call, why) = placement(Ok(by_id), Err("undefined symbol"), 0).unwrap_err();
        assert_eq!(call, "nvmlGpuInstanceGetInfo");
        assert!(why.contains("undefined symbol"), "{why}");
        let (call, _) = placement(Err("undefined symbol"), Ok(info), 0).unwrap_err();
        assert_eq!(call, "nvmlDeviceGetGpuInstanceById");
    }
}
