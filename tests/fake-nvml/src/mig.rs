//! MIG: the mode, GPU instances, compute instances and MIG devices, served
//! from the live state of `simnode::mig::state` (NVML's rules live there;
//! this module is the C surface and the state's keeping).
//!
//! Keeping: the state starts from the description (or from the file named
//! by `FAKE_NVML_MIG`, when it exists and is about the same GPUs). With
//! `FAKE_NVML_MIG` every change is written to that file atomically and the
//! file is read again whenever it changed, under a lock file
//! (`<file>.lock`), so processes share one layout.
//!
//! Resets: with `FAKE_NVML_SYSFS` (a sysfs tree, e.g. the test host's
//! `sys`), a write to `bus/pci/devices/<bus id>/reset` resets that GPU the
//! next time the library looks at the state: its pending MIG mode applies
//! and its instances are gone, unless its `FAKE_NVML_STATE` condition says
//! `reset-ignored`.
//!
//! Handles are numbers in disguise, never dereferenced: bits 0..16 the GPU
//! index + 1, 16..24 the GPU-instance ID + 1, 24..32 the compute-instance
//! ID + 1, and a kind above bit 40 (MIG device, GPU instance, compute
//! instance). A handle of an instance that is gone answers
//! `NVML_ERROR_INVALID_ARGUMENT`.

use crate::costs;
use std::ffi::{c_char, c_uint};
use std::fs;
use std::io::Write as _;
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};
use std::time::{SystemTime, UNIX_EPOCH};

use nvml_wrapper_sys::bindings::{
    nvmlComputeInstance_t, nvmlComputeInstanceInfo_t, nvmlComputeInstancePlacement_t,
    nvmlComputeInstanceProfileInfo_t, nvmlComputeInstanceProfileInfo_v2_t,
    nvmlComputeInstanceProfileInfo_v3_t, nvmlDevice_t, nvmlDeviceAttributes_t, nvmlGpuInstance_t,
    nvmlGpuInstanceInfo_t, nvmlGpuInstancePlacement_t, nvmlGpuInstanceProfileInfo_t,
    nvmlGpuInstanceProfileInfo_v2_t, nvmlGpuInstanceProfileInfo_v3_t, nvmlProcessInfo_t,
    nvmlReturn_t,
};
use simnode::NodeDescription;
use simnode::mig::state::{GpuMig, MigDevice, MigError, NodeMig};
use simnode::mig::{CiProfile, GiProfile, ci_index, gi_index};

use super::{
    ERROR_GPU_IS_LOST, ERROR_INSUFFICIENT_SIZE, ERROR_INVALID_ARGUMENT, ERROR_NOT_FOUND,
    ERROR_NOT_SUPPORTED, ERROR_UNINITIALIZED, STATE, SUCCESS, answer, conditions_of, handle_for,
};

const ERROR_IN_USE: nvmlReturn_t = 19;
const ERROR_RESET_REQUIRED: nvmlReturn_t = 16;
const ERROR_ARGUMENT_VERSION_MISMATCH: nvmlReturn_t = 25;
/// `NVML_DEVICE_MIG_DISABLE`, `NVML_DEVICE_MIG_ENABLE`.
const MIG_DISABLE: c_uint = 0;
const MIG_ENABLE: c_uint = 1;
/// `NVML_COMPUTE_INSTANCE_ENGINE_PROFILE_SHARED`.
const ENGINE_PROFILE_SHARED: c_uint = 0;
/// "No instance" in a process's GI/CI IDs.
const NO_INSTANCE: c_uint = 0xFFFF_FFFF;

// --- Keeping the state --------------------------------------------------------

/// A file's identity and time: a rename (our atomic write) changes the inode.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Stamp {
    dev: u64,
    ino: u64,
    mtime_ns: i128,
    len: u64,
}

fn stamp(path: &Path) -> Option<Stamp> {
    let m = fs::metadata(path).ok()?;
    Some(Stamp {
        dev: m.dev(),
        ino: m.ino(),
        mtime_ns: i128::from(m.mtime()) * 1_000_000_000 + i128::from(m.mtime_nsec()),
        len: m.len(),
    })
}

/// The live MIG state and where it is kept.
pub(crate) struct MigStore {
    state: NodeMig,
    /// `FAKE_NVML_MIG`.
    path: Option<PathBuf>,
    /// The file as last read or written.
    seen: Option<Stamp>,
}

fn now_ns() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_nanos() as u64)
}

/// The mtime (ns) of GPU `bus_id`'s sysfs reset file, when there is one.
fn reset_file_mtime(bus_id: hostlib::PciAddress) -> Option<u64> {
    let sys = std::env::var_os("FAKE_NVML_SYSFS")?;
    let path = Path::new(&sys)
        .join("bus/pci/devices")
        .join(bus_id.to_string())
        .join("reset");
    let m = fs::metadata(path).ok()?;
    Some(m.mtime() as u64 * 1_000_000_000 + m.mtime_nsec() as u64)
}

impl MigStore {
    /// The state for `node`: `FAKE_NVML_MIG`'s file when it is about these
    /// GPUs, else the description's (written to the file at once).
    pub(crate) fn load(node: &NodeDescription) -> Result<Self, String> {
        let path = std::env::var_os("FAKE_NVML_MIG").map(PathBuf::from);
        let mut store = MigStore {
            state: NodeMig::default(),
            path,
            seen: None,
        };
        let _lock = store.lock();
        if let Some(state) = store.read_file().filter(|s| s.describes(node)) {
            store.state = state;
            store.seen = store.path.as_deref().and_then(stamp);
            return Ok(store);
        }
        store.state = NodeMig::from_description(node)?;
        for (g, d) in store.state.gpus.iter_mut().zip(&node.gpus) {
            g.reset_mark_ns = reset_file_mtime(d.bus_id);
        }
        store.write_file();
        Ok(store)
    }

    /// Held while a call reads and changes the shared file.
    fn lock(&self) -> Option<fs::File> {
        let path = self.path.as_ref()?;
        let mut lock = path.clone().into_os_string();
        lock.push(".lock");
        let f = fs::OpenOptions::new()
            .create(true)
            .truncate(false)
            .write(true)
            .open(lock)
            .ok()?;
        f.lock().ok()?;
        Some(f)
    }

    fn read_file(&self) -> Option<NodeMig> {
        let text = fs::read_to_string(self.path.as_ref()?).ok()?;
        match serde_json::from_str(&text) {
            Ok(s) => Some(s),
            Err(e) => {
                eprintln!("fake libnvidia-ml: FAKE_NVML_MIG: {e}");
                None
            }
        }
    }

    /// Writes the state to a temporary file and renames it over the file.
    fn write_file(&mut self) {
        let Some(path) = self.path.clone() else {
            return;
        };
        let mut tmp = path.clone().into_os_string();
        tmp.push(format!(".{}.tmp", std::process::id()));
        let tmp = PathBuf::from(tmp);
        let text = serde_json::to_string_pretty(&self.state).expect("the state serializes");
        let written = fs::File::create(&tmp)
            .and_then(|mut f| f.write_all(text.as_bytes()).and_then(|()| f.sync_all()))
            .and_then(|()| fs::rename(&tmp, &path));
        match written {
            Ok(()) => self.seen = stamp(&path),
            Err(e) => eprintln!("fake libnvidia-ml: {}: {e}", path.display()),
        }
    }

    /// Reads the file again if another process changed it.
    fn refresh(&mut self, node: &NodeDescription) {
        let Some(path) = &self.path else {
            return;
        };
        let now = stamp(path);
        if now.is_none() || now == self.seen {
            return;
        }
        if let Some(s) = self.read_file().filter(|s| s.describes(node)) {
            self.state = s;
        }
        self.seen = now;
    }

    /// Applies the resets written to GPUs' sysfs reset files since we last
    /// looked (or since their mode went pending).
    fn apply_resets(&mut self, node: &NodeDescription) {
        for (i, (g, d)) in self.state.gpus.iter_mut().zip(&node.gpus).enumerate() {
            let Some(mtime) = reset_file_mtime(d.bus_id) else {
                continue;
            };
            let written_since_pending = g.pending_since_ns.is_some_and(|t| mtime > t);
            if g.reset_mark_ns == Some(mtime) && !written_since_pending {
                continue;
            }
            if g.reset_mark_ns.is_some() || written_since_pending {
                if conditions_of(i, &g.uuid)
                    .iter()
                    .any(|w| w == "reset-ignored")
                {
                    g.pending_since_ns = None;
                } else {
                    g.reset();
                }
            }
            g.reset_mark_ns = Some(mtime);
        }
    }
}

/// Runs `f` with the description and the live MIG state; writes the state
/// back if `f` changed it. `ERROR_UNINITIALIZED` before `nvmlInit`.
fn live(f: impl FnOnce(&NodeDescription, &mut NodeMig) -> nvmlReturn_t) -> nvmlReturn_t {
    let mut guard = STATE.lock().unwrap_or_else(|p| p.into_inner());
    let Some(s) = guard.as_mut().filter(|s| s.inits > 0) else {
        return ERROR_UNINITIALIZED;
    };
    let store = &mut s.mig;
    let _lock = store.lock();
    store.refresh(&s.node);
    let before = store.state.clone();
    store.apply_resets(&s.node);
    let ret = f(&s.node, &mut store.state);
    if store.state != before {
        store.write_file();
    }
    ret
}

// --- Handles ------------------------------------------------------------------

const KIND_SHIFT: usize = 40;
const KIND_MIG_DEVICE: usize = 1;
const KIND_GPU_INSTANCE: usize = 2;
const KIND_COMPUTE_INSTANCE: usize = 3;

/// What a handle names.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Decoded {
    kind: usize,
    gpu: usize,
    gi: u32,
    ci: u32,
}

fn encode(kind: usize, gpu: usize, gi: u32, ci: u32) -> usize {
    (kind << KIND_SHIFT) | (gpu + 1) | ((gi as usize + 1) << 16) | ((ci as usize + 1) << 24)
}

fn decode(raw: usize) -> Decoded {
    Decoded {
        kind: raw >> KIND_SHIFT,
        gpu: (raw & 0xffff).wrapping_sub(1),
        gi: ((raw >> 16) & 0xff).wrapping_sub(1) as u32,
        ci: ((raw >> 24) & 0xff).wrapping_sub(1) as u32,
    }
}

pub(crate) fn is_mig_handle(device: nvmlDevice_t) -> bool {
    decode(device as usize).kind == KIND_MIG_DEVICE
}

fn mig_handle(gpu: usize, gi: u32, ci: u32) -> nvmlDevice_t {
    encode(KIND_MIG_DEVICE, gpu, gi, ci) as nvmlDevice_t
}

fn gi_handle(gpu: usize, gi: u32) -> nvmlGpuInstance_t {
    encode(KIND_GPU_INSTANCE, gpu, gi, 0) as nvmlGpuInstance_t
}

fn ci_handle(gpu: usize, gi: u32, ci: u32) -> nvmlComputeInstance_t {
    encode(KIND_COMPUTE_INSTANCE, gpu, gi, ci) as nvmlComputeInstance_t
}

/// The GPU index behind a handle of `kind` (a whole GPU: kind 0), checked
/// against the node and the `lost` condition.
fn gpu_of(
    node: &NodeDescription,
    raw: usize,
    kind: usize,
) -> Result<(usize, Decoded), nvmlReturn_t> {
    let d = if kind == 0 {
        if raw == 0 || raw > node.gpus.len() {
            return Err(ERROR_INVALID_ARGUMENT);
        }
        Decoded {
            kind: 0,
            gpu: raw - 1,
            gi: 0,
            ci: 0,
        }
    } else {
        let d = decode(raw);
        if d.kind != kind || d.gpu >= node.gpus.len() {
            return Err(ERROR_INVALID_ARGUMENT);
        }
        d
    };
    if conditions_of(d.gpu, &node.gpus[d.gpu].uuid)
        .iter()
        .any(|w| w == "lost")
    {
        return Err(ERROR_GPU_IS_LOST);
    }
    Ok((d.gpu, d))
}

/// Runs `f` with the live state of the whole GPU behind `device`.
fn with_gpu_mig(
    device: nvmlDevice_t,
    f: impl FnOnce(usize, &mut GpuMig) -> nvmlReturn_t,
) -> nvmlReturn_t {
    live(|node, state| match gpu_of(node, device as usize, 0) {
        Ok((i, _)) => f(i, &mut state.gpus[i]),
        Err(e) => e,
    })
}

/// Runs `f` with the GPU instance behind `gi` (its GPU index, the GPU's
/// state and the GI's ID); a GI that is gone is an invalid argument.
fn with_gi(
    gi: nvmlGpuInstance_t,
    f: impl FnOnce(usize, &mut GpuMig, u32) -> nvmlReturn_t,
) -> nvmlReturn_t {
    live(
        |node, state| match gpu_of(node, gi as usize, KIND_GPU_INSTANCE) {
            Ok((i, d)) => {
                let g = &mut state.gpus[i];
                if !g.current || g.gpu_instance(d.gi).is_none() {
                    return ERROR_INVALID_ARGUMENT;
                }
                f(i, g, d.gi)
            }
            Err(e) => e,
        },
    )
}

/// Runs `f` with the compute instance behind `ci`.
fn with_ci(
    ci: nvmlComputeInstance_t,
    f: impl FnOnce(usize, &mut GpuMig, u32, u32) -> nvmlReturn_t,
) -> nvmlReturn_t {
    live(
        |node, state| match gpu_of(node, ci as usize, KIND_COMPUTE_INSTANCE) {
            Ok((i, d)) => {
                let g = &mut state.gpus[i];
                let exists = g
                    .gpu_instance(d.gi)
                    .is_some_and(|x| x.compute_instances.iter().any(|c| c.id == d.ci));
                if !g.current || !exists {
                    return ERROR_INVALID_ARGUMENT;
                }
                f(i, g, d.gi, d.ci)
            }
            Err(e) => e,
        },
    )
}

/// Whether the whole GPU behind `device` has MIG on and a GPU instance
/// `id` (what `nvmlGpmMigSampleGet` takes).
pub(crate) fn has_gpu_instance(device: nvmlDevice_t, id: u32) -> bool {
    let mut found = false;
    live(|node, state| {
        if let Ok((i, _)) = gpu_of(node, device as usize, 0) {
            let g = &state.gpus[i];
            found = g.current && g.gpu_instance(id).is_some();
        }
        SUCCESS
    });
    found
}

/// Runs `f` with the MIG device behind a MIG handle.
pub(crate) fn with_mig_device(
    device: nvmlDevice_t,
    f: impl FnOnce(&MigDevice) -> nvmlReturn_t,
) -> nvmlReturn_t {
    live(
        |node, state| match gpu_of(node, device as usize, KIND_MIG_DEVICE) {
            Ok((i, d)) => match state.gpus[i]
                .mig_devices()
                .iter()
                .find(|m| m.gi_id == d.gi && m.ci_id == d.ci)
            {
                Some(m) => f(m),
                None => ERROR_INVALID_ARGUMENT,
            },
            Err(e) => e,
        },
    )
}

fn code(e: MigError) -> nvmlReturn_t {
    e.nvml_return()
}

/// Copies `s` into a fixed C name field.
fn fill_name(dst: &mut [c_char], s: &str) {
    dst.fill(0);
    let room = dst.len() - 1;
    for (d, b) in dst.iter_mut().zip(s.bytes().take(room)) {
        *d = b as c_char;
    }
}

/// `NVML_STRUCT_VERSION(T, v)`: the struct's size with the version above bit 24.
const fn struct_version<T>(v: u32) -> u32 {
    std::mem::size_of::<T>() as u32 | (v << 24)
}

// --- MIG mode -----------------------------------------------------------------

#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetMigMode(
    device: nvmlDevice_t,
    current: *mut c_uint,
    pending: *mut c_uint,
) -> nvmlReturn_t {
    let _cost = costs::charge("nvmlDeviceGetMigMode");
    if current.is_null() || pending.is_null() {
        return ERROR_INVALID_ARGUMENT;
    }
    with_gpu_mig(device, |_, g| {
        if !g.capable {
            return ERROR_NOT_SUPPORTED;
        }
        // SAFETY: both out-pointers were checked non-null above.
        unsafe {
            *current = c_uint::from(g.current);
            *pending = c_uint::from(g.pending);
        }
        SUCCESS
    })
}

/// Sets the MIG mode. Hopper: at once (`IN_USE` while GPU instances exist);
/// Ampere: pending, with `activationStatus` `RESET_REQUIRED`. A GPU whose
/// condition is `busy` answers `IN_USE`.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceSetMigMode(
    device: nvmlDevice_t,
    mode: c_uint,
    activation_status: *mut nvmlReturn_t,
) -> nvmlReturn_t {
    let _cost = costs::charge("nvmlDeviceSetMigMode");
    if activation_status.is_null() || !matches!(mode, MIG_DISABLE | MIG_ENABLE) {
        return ERROR_INVALID_ARGUMENT;
    }
    let status = |v: nvmlReturn_t| {
        // SAFETY: checked non-null above.
        unsafe { *activation_status = v };
    };
    with_gpu_mig(device, |i, g| {
        if g.capable && conditions_of(i, &g.uuid).iter().any(|w| w == "busy") {
            status(ERROR_IN_USE);
            return ERROR_IN_USE;
        }
        // The reset file's time was noted as this call began: only a reset
        // written from now on applies a pending mode.
        match g.set_mode(mode == MIG_ENABLE, now_ns()) {
            Ok(true) => {
                status(SUCCESS);
                SUCCESS
            }
            Ok(false) => {
                status(ERROR_RESET_REQUIRED);
                SUCCESS
            }
            Err(e) => code(e),
        }
    })
}

// --- GPU-instance profiles and placements ---------------------------------------

fn gi_info_v1(p: &GiProfile) -> nvmlGpuInstanceProfileInfo_t {
    nvmlGpuInstanceProfileInfo_t {
        id: p.id,
        isP2pSupported: 0,
        sliceCount: p.slices,
        instanceCount: p.instances,
        multiprocessorCount: p.multiprocessors,
        copyEngineCount: p.engines.copy,
        decoderCount: p.engines.decoder,
        encoderCount: p.engines.encoder,
        jpegCount: p.engines.jpeg,
        ofaCount: p.engines.ofa,
        memorySizeMB: p.memory_mib,
    }
}

/// Fills a versioned GI profile info (v2 or v3, as the caller's `version` says).
unsafe fn fill_gi_info_v(
    p: &GiProfile,
    info: *mut nvmlGpuInstanceProfileInfo_v2_t,
) -> nvmlReturn_t {
    // SAFETY: the caller checked `info` non-null; every version starts with `version`.
    let version = unsafe { (*info).version };
    let v1 = gi_info_v1(p);
    let name = format!("MIG {}", p.name);
    if version == struct_version::<nvmlGpuInstanceProfileInfo_v2_t>(2) {
        // SAFETY: the caller passes a v2 struct (its version says so).
        let out = unsafe { &mut *info };
        *out = nvmlGpuInstanceProfileInfo_v2_t {
            version,
            id: v1.id,
            isP2pSupported: v1.isP2pSupported,
            sliceCount: v1.sliceCount,
            instanceCount: v1.instanceCount,
            multiprocessorCount: v1.multiprocessorCount,
            copyEngineCount: v1.copyEngineCount,
            decoderCount: v1.decoderCount,
            encoderCount: v1.encoderCount,
            jpegCount: v1.jpegCount,
            ofaCount: v1.ofaCount,
            memorySizeMB: v1.memorySizeMB,
            name: [0; 96],
        };
        fill_name(&mut out.name, &name);
        SUCCESS
    } else if version == struct_version::<nvmlGpuInstanceProfileInfo_v3_t>(3) {
        // SAFETY: the caller passes a v3 struct (its version says so).
        let out = unsafe { &mut *info.cast::<nvmlGpuInstanceProfileInfo_v3_t>() };
        *out = nvmlGpuInstanceProfileInfo_v3_t {
            version,
            id: v1.id,
            sliceCount: v1.sliceCount,
            instanceCount: v1.instanceCount,
            multiprocessorCount: v1.multiprocessorCount,
            copyEngineCount: v1.copyEngineCount,
            decoderCount: v1.decoderCount,
            encoderCount: v1.encoderCount,
            jpegCount: v1.jpegCount,
            ofaCount: v1.ofaCount,
            memorySizeMB: v1.memorySizeMB,
            name: [0; 96],
            capabilities: 0,
        };
        fill_name(&mut out.name, &name);
        SUCCESS
    } else {
        ERROR_ARGUMENT_VERSION_MISMATCH
    }
}

/// The profile with NVML index `profile` on GPU `g`: `INVALID_ARGUMENT`
/// past the last index, `NOT_SUPPORTED` where the GPU lacks it.
fn gi_profile_by_index(g: &GpuMig, profile: c_uint) -> Result<&'static GiProfile, nvmlReturn_t> {
    if !g.capable {
        return Err(ERROR_NOT_SUPPORTED);
    }
    if profile >= gi_index::COUNT {
        return Err(ERROR_INVALID_ARGUMENT);
    }
    g.facts().by_index(profile).ok_or(ERROR_NOT_SUPPORTED)
}

fn gi_profile_by_id(g: &GpuMig, id: c_uint) -> Result<&'static GiProfile, nvmlReturn_t> {
    if !g.capable {
        return Err(ERROR_NOT_SUPPORTED);
    }
    g.facts().by_id(id).ok_or(ERROR_NOT_SUPPORTED)
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetGpuInstanceProfileInfo(
    device: nvmlDevice_t,
    profile: c_uint,
    info: *mut nvmlGpuInstanceProfileInfo_t,
) -> nvmlReturn_t {
    let _cost = costs::charge("nvmlDeviceGetGpuInstanceProfileInfo");
    with_gpu_mig(device, |_, g| match gi_profile_by_index(g, profile) {
        // SAFETY: `info` is the caller's out-pointer (checked by `answer`).
        Ok(p) => unsafe { answer(info, Some(gi_info_v1(p))) },
        Err(e) => e,
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetGpuInstanceProfileInfoV(
    device: nvmlDevice_t,
    profile: c_uint,
    info: *mut nvmlGpuInstanceProfileInfo_v2_t,
) -> nvmlReturn_t {
    let _cost = costs::charge("nvmlDeviceGetGpuInstanceProfileInfoV");
    if info.is_null() {
        return ERROR_INVALID_ARGUMENT;
    }
    with_gpu_mig(device, |_, g| match gi_profile_by_index(g, profile) {
        // SAFETY: checked non-null above.
        Ok(p) => unsafe { fill_gi_info_v(p, info) },
        Err(e) => e,
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetGpuInstanceProfileInfoByIdV(
    device: nvmlDevice_t,
    profile_id: c_uint,
    info: *mut nvmlGpuInstanceProfileInfo_v2_t,
) -> nvmlReturn_t {
    let _cost = costs::charge("nvmlDeviceGetGpuInstanceProfileInfoByIdV");
    if info.is_null() {
        return ERROR_INVALID_ARGUMENT;
    }
    with_gpu_mig(device, |_, g| match gi_profile_by_id(g, profile_id) {
        // SAFETY: checked non-null above.
        Ok(p) => unsafe { fill_gi_info_v(p, info) },
        Err(e) => e,
    })
}

/// Writes `items` to a caller array of `*count` entries: with a null array,
/// only the count (NVML's size query); too small, `INSUFFICIENT_SIZE` with
/// the count needed.
unsafe fn write_list<T: Copy>(items: &[T], out: *mut T, count: *mut c_uint) -> nvmlReturn_t {
    if count.is_null() {
        return ERROR_INVALID_ARGUMENT;
    }
    // SAFETY: checked non-null; the caller's in/out count.
    let room = unsafe { *count } as usize;
    // SAFETY: as above.
    unsafe { *count = items.len() as c_uint };
    if out.is_null() {
        return SUCCESS;
    }
    if room < items.len() {
        return ERROR_INSUFFICIENT_SIZE;
    }
    // SAFETY: the caller's array holds `room` >= items.len() entries.
    unsafe { std::ptr::copy_nonoverlapping(items.as_ptr(), out, items.len()) };
    SUCCESS
}

/// Every placement the profile has, free or not, whether MIG is on or off.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetGpuInstancePossiblePlacements_v2(
    device: nvmlDevice_t,
    profile_id: c_uint,
    placements: *mut nvmlGpuInstancePlacement_t,
    count: *mut c_uint,
) -> nvmlReturn_t {
    let _cost = costs::charge("nvmlDeviceGetGpuInstancePossiblePlacements_v2");
    with_gpu_mig(device, |_, g| match gi_profile_by_id(g, profile_id) {
        Ok(p) => {
            let list: Vec<nvmlGpuInstancePlacement_t> = p
                .placements
                .iter()
                .map(|&start| nvmlGpuInstancePlacement_t {
                    start,
                    size: p.placement_size,
                })
                .collect();
            // SAFETY: the caller's array and count.
            unsafe { write_list(&list, placements, count) }
        }
        Err(e) => e,
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetGpuInstanceRemainingCapacity(
    device: nvmlDevice_t,
    profile_id: c_uint,
    count: *mut c_uint,
) -> nvmlReturn_t {
    let _cost = costs::charge("nvmlDeviceGetGpuInstanceRemainingCapacity");
    with_gpu_mig(device, |_, g| match g.gpu_instance_capacity(profile_id) {
        // SAFETY: `count` is the caller's out-pointer.
        Ok(n) => unsafe { answer(count, Some(n)) },
        Err(e) => code(e),
    })
}

// --- GPU instances --------------------------------------------------------------

fn create_gi(
    device: nvmlDevice_t,
    profile_id: c_uint,
    placement: Option<nvmlGpuInstancePlacement_t>,
    out: *mut nvmlGpuInstance_t,
) -> nvmlReturn_t {
    if out.is_null() {
        return ERROR_INVALID_ARGUMENT;
    }
    with_gpu_mig(device, |i, g| {
        if let Some(pl) = placement
            && g.facts()
                .by_id(profile_id)
                .is_some_and(|p| p.placement_size != pl.size)
        {
            return ERROR_INVALID_ARGUMENT;
        }
        match g.create_gpu_instance(profile_id, placement.map(|p| p.start)) {
            Ok(id) => {
                // SAFETY: checked non-null above.
                unsafe { *out = gi_handle(i, id) };
                SUCCESS
            }
            Err(e) => code(e),
        }
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceCreateGpuInstance(
    device: nvmlDevice_t,
    profile_id: c_uint,
    gpu_instance: *mut nvmlGpuInstance_t,
) -> nvmlReturn_t {
    let _cost = costs::charge("nvmlDeviceCreateGpuInstance");
    create_gi(device, profile_id, None, gpu_instance)
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceCreateGpuInstanceWithPlacement(
    device: nvmlDevice_t,
    profile_id: c_uint,
    placement: *const nvmlGpuInstancePlacement_t,
    gpu_instance: *mut nvmlGpuInstance_t,
) -> nvmlReturn_t {
    let _cost = costs::charge("nvmlDeviceCreateGpuInstanceWithPlacement");
    if placement.is_null() {
        return ERROR_INVALID_ARGUMENT;
    }
    // SAFETY: checked non-null; the caller's placement.
    let pl = unsafe { *placement };
    create_gi(device, profile_id, Some(pl), gpu_instance)
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlGpuInstanceDestroy(gpu_instance: nvmlGpuInstance_t) -> nvmlReturn_t {
    let _cost = costs::charge("nvmlGpuInstanceDestroy");
    with_gi(gpu_instance, |_, g, gi| match g.destroy_gpu_instance(gi) {
        Ok(()) => SUCCESS,
        Err(e) => code(e),
    })
}

/// The GPU instances of one profile.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetGpuInstances(
    device: nvmlDevice_t,
    profile_id: c_uint,
    gpu_instances: *mut nvmlGpuInstance_t,
    count: *mut c_uint,
) -> nvmlReturn_t {
    let _cost = costs::charge("nvmlDeviceGetGpuInstances");
    if gpu_instances.is_null() || count.is_null() {
        return ERROR_INVALID_ARGUMENT;
    }
    with_gpu_mig(device, |i, g| {
        if !g.capable || !g.current {
            return ERROR_NOT_SUPPORTED;
        }
        let p = match gi_profile_by_id(g, profile_id) {
            Ok(p) => p,
            Err(e) => return e,
        };
        let list: Vec<nvmlGpuInstance_t> = g
            .gpu_instances
            .iter()
            .filter(|x| x.profile_id == profile_id)
            .map(|x| gi_handle(i, x.id))
            .collect();
        // SAFETY: NVML asks for room for the profile's instance count.
        unsafe { *count = p.instances };
        // SAFETY: the caller's array, sized as above.
        unsafe { write_list(&list, gpu_instances, count) }
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetGpuInstanceById(
    device: nvmlDevice_t,
    id: c_uint,
    gpu_instance: *mut nvmlGpuInstance_t,
) -> nvmlReturn_t {
    let _cost = costs::charge("nvmlDeviceGetGpuInstanceById");
    if gpu_instance.is_null() {
        return ERROR_INVALID_ARGUMENT;
    }
    with_gpu_mig(device, |i, g| {
        if !g.capable || !g.current {
            return ERROR_NOT_SUPPORTED;
        }
        if g.gpu_instance(id).is_none() {
            return ERROR_NOT_FOUND;
        }
        // SAFETY: checked non-null above.
        unsafe { *gpu_instance = gi_handle(i, id) };
        SUCCESS
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlGpuInstanceGetInfo(
    gpu_instance: nvmlGpuInstance_t,
    info: *mut nvmlGpuInstanceInfo_t,
) -> nvmlReturn_t {
    let _cost = costs::charge("nvmlGpuInstanceGetInfo");
    with_gi(gpu_instance, |i, g, gi| {
        let x = g.gpu_instance(gi).expect("checked by with_gi");
        let v = nvmlGpuInstanceInfo_t {
            device: handle_for(i),
            id: x.id,
            profileId: x.profile_id,
            placement: nvmlGpuInstancePlacement_t {
                start: x.start,
                size: x.size,
            },
        };
        // SAFETY: `info` is the caller's out-pointer.
        unsafe { answer(info, Some(v)) }
    })
}

// --- Compute instances ------------------------------------------------------------

/// The compute-instance profile `profile` of GPU instance `gi`.
fn ci_profile(g: &GpuMig, gi: u32, profile: c_uint) -> Result<CiProfile, nvmlReturn_t> {
    if profile >= ci_index::COUNT {
        return Err(ERROR_INVALID_ARGUMENT);
    }
    g.ci_profiles(gi)
        .map_err(code)?
        .into_iter()
        .find(|c| c.index == profile)
        .ok_or(ERROR_NOT_SUPPORTED)
}

fn ci_info_v1(g: &GpuMig, gi: u32, c: &CiProfile) -> nvmlComputeInstanceProfileInfo_t {
    let e = g
        .gpu_instance(gi)
        .and_then(|x| g.facts().by_id(x.profile_id))
        .map(|p| p.engines)
        .unwrap_or_default();
    nvmlComputeInstanceProfileInfo_t {
        id: c.index,
        sliceCount: c.slices,
        instanceCount: c.instances,
        multiprocessorCount: c.multiprocessors,
        sharedCopyEngineCount: e.copy,
        sharedDecoderCount: e.decoder,
        sharedEncoderCount: e.encoder,
        sharedJpegCount: e.jpeg,
        sharedOfaCount: e.ofa,
    }
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlGpuInstanceGetComputeInstanceProfileInfo(
    gpu_instance: nvmlGpuInstance_t,
    profile: c_uint,
    eng_profile: c_uint,
    info: *mut nvmlComputeInstanceProfileInfo_t,
) -> nvmlReturn_t {
    let _cost = costs::charge("nvmlGpuInstanceGetComputeInstanceProfileInfo");
    if eng_profile != ENGINE_PROFILE_SHARED {
        return ERROR_INVALID_ARGUMENT;
    }
    with_gi(gpu_instance, |_, g, gi| match ci_profile(g, gi, profile) {
        // SAFETY: `info` is the caller's out-pointer.
        Ok(c) => unsafe { answer(info, Some(ci_info_v1(g, gi, &c))) },
        Err(e) => e,
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlGpuInstanceGetComputeInstanceProfileInfoV(
    gpu_instance: nvmlGpuInstance_t,
    profile: c_uint,
    eng_profile: c_uint,
    info: *mut nvmlComputeInstanceProfileInfo_v2_t,
) -> nvmlReturn_t {
    let _cost = costs::charge("nvmlGpuInstanceGetComputeInstanceProfileInfoV");
    if info.is_null() || eng_profile != ENGINE_PROFILE_SHARED {
        return ERROR_INVALID_ARGUMENT;
    }
    with_gi(gpu_instance, |_, g, gi| {
        let c = match ci_profile(g, gi, profile) {
            Ok(c) => c,
            Err(e) => return e,
        };
        let v1 = ci_info_v1(g, gi, &c);
        let name = format!("MIG {}", c.name);
        // SAFETY: checked non-null; every version starts with `version`.
        let version = unsafe { (*info).version };
        if version == struct_version::<nvmlComputeInstanceProfileInfo_v2_t>(2) {
            // SAFETY: the caller passes a v2 struct (its version says so).
            let out = unsafe { &mut *info };
            *out = nvmlComputeInstanceProfileInfo_v2_t {
                version,
                id: v1.id,
                sliceCount: v1.sliceCount,
                instanceCount: v1.instanceCount,
                multiprocessorCount: v1.multiprocessorCount,
                sharedCopyEngineCount: v1.sharedCopyEngineCount,
                sharedDecoderCount: v1.sharedDecoderCount,
                sharedEncoderCount: v1.sharedEncoderCount,
                sharedJpegCount: v1.sharedJpegCount,
                sharedOfaCount: v1.sharedOfaCount,
                name: [0; 96],
            };
            fill_name(&mut out.name, &name);
            SUCCESS
        } else if version == struct_version::<nvmlComputeInstanceProfileInfo_v3_t>(3) {
            // SAFETY: the caller passes a v3 struct (its version says so).
            let out = unsafe { &mut *info.cast::<nvmlComputeInstanceProfileInfo_v3_t>() };
            *out = nvmlComputeInstanceProfileInfo_v3_t {
                version,
                id: v1.id,
                sliceCount: v1.sliceCount,
                instanceCount: v1.instanceCount,
                multiprocessorCount: v1.multiprocessorCount,
                sharedCopyEngineCount: v1.sharedCopyEngineCount,
                sharedDecoderCount: v1.sharedDecoderCount,
                sharedEncoderCount: v1.sharedEncoderCount,
                sharedJpegCount: v1.sharedJpegCount,
                sharedOfaCount: v1.sharedOfaCount,
                name: [0; 96],
                capabilities: 0,
            };
            fill_name(&mut out.name, &name);
            SUCCESS
        } else {
            ERROR_ARGUMENT_VERSION_MISMATCH
        }
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlGpuInstanceGetComputeInstanceRemainingCapacity(
    gpu_instance: nvmlGpuInstance_t,
    profile_id: c_uint,
    count: *mut c_uint,
) -> nvmlReturn_t {
    let _cost = costs::charge("nvmlGpuInstanceGetComputeInstanceRemainingCapacity");
    with_gi(gpu_instance, |_, g, gi| {
        match g.compute_instance_capacity(gi, profile_id) {
            // SAFETY: `count` is the caller's out-pointer.
            Ok(n) => unsafe { answer(count, Some(n)) },
            Err(e) => code(e),
        }
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlGpuInstanceGetComputeInstancePossiblePlacements(
    gpu_instance: nvmlGpuInstance_t,
    profile_id: c_uint,
    placements: *mut nvmlComputeInstancePlacement_t,
    count: *mut c_uint,
) -> nvmlReturn_t {
    let _cost = costs::charge("nvmlGpuInstanceGetComputeInstancePossiblePlacements");
    with_gi(gpu_instance, |_, g, gi| {
        match ci_profile(g, gi, profile_id) {
            Ok(c) => {
                let list: Vec<nvmlComputeInstancePlacement_t> = c
                    .placements
                    .iter()
                    .map(|&start| nvmlComputeInstancePlacement_t {
                        start,
                        size: c.placement_size,
                    })
                    .collect();
                // SAFETY: the caller's array and count.
                unsafe { write_list(&list, placements, count) }
            }
            Err(e) => e,
        }
    })
}

fn create_ci(
    gpu_instance: nvmlGpuInstance_t,
    profile_id: c_uint,
    placement: Option<nvmlComputeInstancePlacement_t>,
    out: *mut nvmlComputeInstance_t,
) -> nvmlReturn_t {
    if out.is_null() {
        return ERROR_INVALID_ARGUMENT;
    }
    with_gi(gpu_instance, |i, g, gi| {
        if let Some(pl) = placement
            && ci_profile(g, gi, profile_id).is_ok_and(|c| c.placement_size != pl.size)
        {
            return ERROR_INVALID_ARGUMENT;
        }
        match g.create_compute_instance(gi, profile_id, placement.map(|p| p.start)) {
            Ok(id) => {
                // SAFETY: checked non-null above.
                unsafe { *out = ci_handle(i, gi, id) };
                SUCCESS
            }
            Err(e) => code(e),
        }
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlGpuInstanceCreateComputeInstance(
    gpu_instance: nvmlGpuInstance_t,
    profile_id: c_uint,
    compute_instance: *mut nvmlComputeInstance_t,
) -> nvmlReturn_t {
    let _cost = costs::charge("nvmlGpuInstanceCreateComputeInstance");
    create_ci(gpu_instance, profile_id, None, compute_instance)
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlGpuInstanceCreateComputeInstanceWithPlacement(
    gpu_instance: nvmlGpuInstance_t,
    profile_id: c_uint,
    placement: *const nvmlComputeInstancePlacement_t,
    compute_instance: *mut nvmlComputeInstance_t,
) -> nvmlReturn_t {
    let _cost = costs::charge("nvmlGpuInstanceCreateComputeInstanceWithPlacement");
    if placement.is_null() {
        return ERROR_INVALID_ARGUMENT;
    }
    // SAFETY: checked non-null; the caller's placement.
    let pl = unsafe { *placement };
    create_ci(gpu_instance, profile_id, Some(pl), compute_instance)
}

/// `IN_USE` while a `FAKE_NVML_STATE` line runs a process on its MIG device.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlComputeInstanceDestroy(
    compute_instance: nvmlComputeInstance_t,
) -> nvmlReturn_t {
    let _cost = costs::charge("nvmlComputeInstanceDestroy");
    with_ci(compute_instance, |i, g, gi, ci| {
        let uuid = g
            .mig_devices()
            .into_iter()
            .find(|m| m.gi_id == gi && m.ci_id == ci)
            .map(|m| m.uuid);
        if uuid.is_some_and(|u| !processes_of(i, &u).is_empty()) {
            return ERROR_IN_USE;
        }
        match g.destroy_compute_instance(gi, ci) {
            Ok(()) => SUCCESS,
            Err(e) => code(e),
        }
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlGpuInstanceGetComputeInstances(
    gpu_instance: nvmlGpuInstance_t,
    profile_id: c_uint,
    compute_instances: *mut nvmlComputeInstance_t,
    count: *mut c_uint,
) -> nvmlReturn_t {
    let _cost = costs::charge("nvmlGpuInstanceGetComputeInstances");
    if compute_instances.is_null() || count.is_null() {
        return ERROR_INVALID_ARGUMENT;
    }
    with_gi(gpu_instance, |i, g, gi| {
        let c = match ci_profile(g, gi, profile_id) {
            Ok(c) => c,
            Err(e) => return e,
        };
        let list: Vec<nvmlComputeInstance_t> = g
            .gpu_instance(gi)
            .expect("checked by with_gi")
            .compute_instances
            .iter()
            .filter(|x| x.profile_id == profile_id)
            .map(|x| ci_handle(i, gi, x.id))
            .collect();
        // SAFETY: NVML asks for room for the profile's instance count.
        unsafe { *count = c.instances };
        // SAFETY: the caller's array, sized as above.
        unsafe { write_list(&list, compute_instances, count) }
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlGpuInstanceGetComputeInstanceById(
    gpu_instance: nvmlGpuInstance_t,
    id: c_uint,
    compute_instance: *mut nvmlComputeInstance_t,
) -> nvmlReturn_t {
    let _cost = costs::charge("nvmlGpuInstanceGetComputeInstanceById");
    if compute_instance.is_null() {
        return ERROR_INVALID_ARGUMENT;
    }
    with_gi(gpu_instance, |i, g, gi| {
        let found = g
            .gpu_instance(gi)
            .is_some_and(|x| x.compute_instances.iter().any(|c| c.id == id));
        if !found {
            return ERROR_NOT_FOUND;
        }
        // SAFETY: checked non-null above.
        unsafe { *compute_instance = ci_handle(i, gi, id) };
        SUCCESS
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlComputeInstanceGetInfo_v2(
    compute_instance: nvmlComputeInstance_t,
    info: *mut nvmlComputeInstanceInfo_t,
) -> nvmlReturn_t {
    let _cost = costs::charge("nvmlComputeInstanceGetInfo_v2");
    with_ci(compute_instance, |i, g, gi, ci| {
        let x = g
            .gpu_instance(gi)
            .and_then(|x| x.compute_instances.iter().find(|c| c.id == ci))
            .expect("checked by with_ci");
        let v = nvmlComputeInstanceInfo_t {
            device: handle_for(i),
            gpuInstance: gi_handle(i, gi),
            id: x.id,
            profileId: x.profile_id,
            placement: nvmlComputeInstancePlacement_t {
                start: x.start,
                size: x.size,
            },
        };
        // SAFETY: `info` is the caller's out-pointer.
        unsafe { answer(info, Some(v)) }
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlComputeInstanceGetInfo(
    compute_instance: nvmlComputeInstance_t,
    info: *mut nvmlComputeInstanceInfo_t,
) -> nvmlReturn_t {
    let _cost = costs::charge("nvmlComputeInstanceGetInfo");
    // SAFETY: same contract.
    unsafe { nvmlComputeInstanceGetInfo_v2(compute_instance, info) }
}

// --- MIG devices --------------------------------------------------------------------

#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceIsMigDeviceHandle(
    device: nvmlDevice_t,
    is_mig: *mut c_uint,
) -> nvmlReturn_t {
    let _cost = costs::charge("nvmlDeviceIsMigDeviceHandle");
    let mig = is_mig_handle(device);
    // SAFETY: `is_mig` is the caller's out-pointer.
    live(|_, _| unsafe { answer(is_mig, Some(c_uint::from(mig))) })
}

/// MIG devices a GPU can hold: one per compute slice.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetMaxMigDeviceCount(
    device: nvmlDevice_t,
    count: *mut c_uint,
) -> nvmlReturn_t {
    let _cost = costs::charge("nvmlDeviceGetMaxMigDeviceCount");
    with_gpu_mig(device, |_, g| {
        let n = g.capable.then(|| g.facts().compute_slices);
        // SAFETY: `count` is the caller's out-pointer.
        unsafe { answer(count, n) }
    })
}

/// The `index`-th MIG device, by GPU-instance ID then compute-instance ID.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetMigDeviceHandleByIndex(
    device: nvmlDevice_t,
    index: c_uint,
    mig: *mut nvmlDevice_t,
) -> nvmlReturn_t {
    let _cost = costs::charge("nvmlDeviceGetMigDeviceHandleByIndex");
    if mig.is_null() {
        return ERROR_INVALID_ARGUMENT;
    }
    with_gpu_mig(device, |i, g| {
        if !g.capable {
            return ERROR_NOT_SUPPORTED;
        }
        if index >= g.facts().compute_slices {
            return ERROR_INVALID_ARGUMENT;
        }
        match g.mig_devices().get(index as usize) {
            Some(m) => {
                // SAFETY: checked non-null above.
                unsafe { *mig = mig_handle(i, m.gi_id, m.ci_id) };
                SUCCESS
            }
            None => ERROR_NOT_FOUND,
        }
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetDeviceHandleFromMigDeviceHandle(
    mig: nvmlDevice_t,
    device: *mut nvmlDevice_t,
) -> nvmlReturn_t {
    let _cost = costs::charge("nvmlDeviceGetDeviceHandleFromMigDeviceHandle");
    if !is_mig_handle(mig) {
        return ERROR_INVALID_ARGUMENT;
    }
    let gpu = decode(mig as usize).gpu;
    // SAFETY: `device` is the caller's out-pointer.
    with_mig_device(mig, |_| unsafe { answer(device, Some(handle_for(gpu))) })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetAttributes_v2(
    device: nvmlDevice_t,
    attrs: *mut nvmlDeviceAttributes_t,
) -> nvmlReturn_t {
    let _cost = costs::charge("nvmlDeviceGetAttributes_v2");
    if !is_mig_handle(device) {
        // Whole GPUs: nothing in a node description says this.
        return with_gpu_mig(device, |_, _| ERROR_NOT_SUPPORTED);
    }
    with_mig_device(device, |m| {
        let a = nvmlDeviceAttributes_t {
            multiprocessorCount: m.multiprocessors,
            sharedCopyEngineCount: m.engines.copy,
            sharedDecoderCount: m.engines.decoder,
            sharedEncoderCount: m.engines.encoder,
            sharedJpegCount: m.engines.jpeg,
            sharedOfaCount: m.engines.ofa,
            gpuInstanceSliceCount: m.gi_slices,
            computeInstanceSliceCount: m.ci_slices,
            memorySizeMB: m.memory_mib,
        };
        // SAFETY: `attrs` is the caller's out-pointer.
        unsafe { answer(attrs, Some(a)) }
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetGpuInstanceId(
    device: nvmlDevice_t,
    id: *mut c_uint,
) -> nvmlReturn_t {
    let _cost = costs::charge("nvmlDeviceGetGpuInstanceId");
    if !is_mig_handle(device) {
        return with_gpu_mig(device, |_, _| ERROR_NOT_SUPPORTED);
    }
    // SAFETY: `id` is the caller's out-pointer.
    with_mig_device(device, |m| unsafe { answer(id, Some(m.gi_id)) })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetComputeInstanceId(
    device: nvmlDevice_t,
    id: *mut c_uint,
) -> nvmlReturn_t {
    let _cost = costs::charge("nvmlDeviceGetComputeInstanceId");
    if !is_mig_handle(device) {
        return with_gpu_mig(device, |_, _| ERROR_NOT_SUPPORTED);
    }
    // SAFETY: `id` is the caller's out-pointer.
    with_mig_device(device, |m| unsafe { answer(id, Some(m.ci_id)) })
}

// --- Running processes --------------------------------------------------------------

/// PIDs `FAKE_NVML_STATE` runs on `who` (GPU `index`'s UUID or index, or a
/// MIG device's UUID): lines `<who> process <pid>`.
fn processes_of(index: usize, uuid: &str) -> Vec<u32> {
    conditions_of(index, uuid)
        .iter()
        .filter_map(|w| w.strip_prefix("process "))
        .filter_map(|pid| pid.trim().parse().ok())
        .collect()
}

fn process(pid: u32, gi: c_uint, ci: c_uint) -> nvmlProcessInfo_t {
    nvmlProcessInfo_t {
        pid,
        usedGpuMemory: 0,
        gpuInstanceId: gi,
        computeInstanceId: ci,
    }
}

/// Compute processes: a GPU's lines (no instance), and on a MIG-mode GPU
/// its MIG devices' lines with their GI/CI IDs; a MIG handle, its own.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetComputeRunningProcesses_v3(
    device: nvmlDevice_t,
    count: *mut c_uint,
    infos: *mut nvmlProcessInfo_t,
) -> nvmlReturn_t {
    let _cost = costs::charge("nvmlDeviceGetComputeRunningProcesses_v3");
    if count.is_null() {
        return ERROR_INVALID_ARGUMENT;
    }
    let list = |procs: Vec<nvmlProcessInfo_t>| {
        // SAFETY: the caller's count and array.
        let room = unsafe { *count } as usize;
        // SAFETY: checked non-null above.
        unsafe { *count = procs.len() as c_uint };
        if procs.is_empty() {
            return SUCCESS;
        }
        if infos.is_null() || room < procs.len() {
            return ERROR_INSUFFICIENT_SIZE;
        }
        // SAFETY: the caller's array holds `room` entries.
        unsafe { std::ptr::copy_nonoverlapping(procs.as_ptr(), infos, procs.len()) };
        SUCCESS
    };
    if is_mig_handle(device) {
        let gpu = decode(device as usize).gpu;
        return with_mig_device(device, |m| {
            list(
                processes_of(gpu, &m.uuid)
                    .into_iter()
                    .map(|p| process(p, m.gi_id, m.ci_id))
                    .collect(),
            )
        });
    }
    with_gpu_mig(device, |i, g| {
        let mut procs: Vec<nvmlProcessInfo_t> = processes_of(i, &g.uuid)
            .into_iter()
            .map(|p| process(p, NO_INSTANCE, NO_INSTANCE))
            .collect();
        for m in g.mig_devices() {
            procs.extend(
                processes_of(usize::MAX, &m.uuid)
                    .into_iter()
                    .map(|p| process(p, m.gi_id, m.ci_id)),
            );
        }
        list(procs)
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn handles_round_trip_and_do_not_collide() {
        let m = mig_handle(3, 14, 7) as usize;
        assert_eq!(
            decode(m),
            Decoded {
                kind: KIND_MIG_DEVICE,
                gpu: 3,
                gi: 14,
                ci: 7
            }
        );
        assert!(is_mig_handle(m as nvmlDevice_t));
        assert!(!is_mig_handle(handle_for(3)));
        assert!(!is_mig_handle(gi_handle(3, 14) as nvmlDevice_t));
        assert_eq!(
            decode(ci_handle(0, 0, 0) as usize).kind,
            KIND_COMPUTE_INSTANCE
        );
        assert_ne!(gi_handle(0, 1) as usize, ci_handle(0, 1, 0) as usize);
    }

    /// What gpu-agent's NVML backend asks of a MIG device, in its order:
    /// its GPU-instance ID, the parent's GPU instance by that ID, and the
    /// instance's info; `(profileId, placement.start)` per MIG device.
    fn placements_through_nvml(gpu: usize) -> Vec<(u32, u32)> {
        let parent = handle_for(gpu);
        let mut count: c_uint = 0;
        // SAFETY: valid out-pointers for each call, as a C caller passes.
        unsafe {
            assert_eq!(nvmlDeviceGetMaxMigDeviceCount(parent, &mut count), SUCCESS);
            let mut out = Vec::new();
            for k in 0..count {
                let mut mig: nvmlDevice_t = std::ptr::null_mut();
                if nvmlDeviceGetMigDeviceHandleByIndex(parent, k, &mut mig) == ERROR_NOT_FOUND {
                    continue;
                }
                let mut gi_id: c_uint = 0;
                assert_eq!(nvmlDeviceGetGpuInstanceId(mig, &mut gi_id), SUCCESS);
                let mut gi: nvmlGpuInstance_t = std::ptr::null_mut();
                assert_eq!(
                    nvmlDeviceGetGpuInstanceById(parent, gi_id, &mut gi),
                    SUCCESS
                );
                let mut info: nvmlGpuInstanceInfo_t = std::mem::zeroed();
                assert_eq!(nvmlGpuInstanceGetInfo(gi, &mut info), SUCCESS);
                assert_eq!(info.id, gi_id);
                assert_eq!(info.device, parent);
                out.push((info.profileId, info.placement.start));
            }
            out
        }
    }

    #[test]
    fn a_mig_devices_gpu_instance_says_its_profile_id_and_placement() {
        let node = NodeDescription::load("h100-mig-2").unwrap();
        let mig = MigStore::load(&node).unwrap();
        *STATE.lock().unwrap_or_else(|p| p.into_inner()) = Some(crate::State {
            node,
            mig,
            inits: 1,
            loaded: std::time::Instant::now(),
        });
        // The H100's profile IDs as `nvidia-smi mig -lgip` lists them
        // (3g.40gb 9, 2g.20gb 14, 1g.10gb 19), at the starts simnode's
        // state placed the described devices at (the simulated backend's).
        assert_eq!(
            placements_through_nvml(0),
            [(9, 4), (14, 0), (19, 2), (19, 3)]
        );
        assert_eq!(
            placements_through_nvml(1),
            [6, 4, 5, 0, 1, 2, 3].map(|s| (19, s))
        );
        // An ID with no GPU instance is not found.
        let mut gi: nvmlGpuInstance_t = std::ptr::null_mut();
        // SAFETY: a valid out-pointer.
        let rc = unsafe { nvmlDeviceGetGpuInstanceById(handle_for(0), 12, &mut gi) };
        assert_eq!(rc, ERROR_NOT_FOUND);
        *STATE.lock().unwrap_or_else(|p| p.into_inner()) = None;
    }

    #[test]
    fn versions_are_nvml_struct_versions() {
        // sizeof(nvmlGpuInstanceProfileInfo_v2_t) is 152 on 64-bit Linux.
        assert_eq!(
            struct_version::<nvmlGpuInstanceProfileInfo_v2_t>(2),
            0x0200_0098
        );
        assert_eq!(
            struct_version::<nvmlComputeInstanceProfileInfo_v2_t>(2) >> 24,
            2
        );
    }
}
