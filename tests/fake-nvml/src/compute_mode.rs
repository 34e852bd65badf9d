//! Compute modes: `nvmlDeviceGetComputeMode` and `nvmlDeviceSetComputeMode`.
//!
//! Every GPU starts in `NVML_COMPUTEMODE_DEFAULT`. A mode set is kept for
//! the life of the process, across `nvmlShutdown` (as the driver keeps it
//! until the GPU is reset). When `FAKE_NVML_COMPUTE_MODES` names a file,
//! every set rewrites it with one line per GPU, `<UUID> <MODE>` (`DEFAULT`,
//! `EXCLUSIVE_PROCESS`, `PROHIBITED`), so that a test sees what the process
//! it runs set. `EXCLUSIVE_THREAD` is refused with `NOT_SUPPORTED`, as by
//! drivers since CUDA 8; MIG device handles are refused with
//! `INVALID_ARGUMENT`.

use crate::costs;
use std::collections::BTreeMap;
use std::sync::Mutex;

use nvml_wrapper_sys::bindings::{nvmlComputeMode_t, nvmlDevice_t, nvmlReturn_t};

use super::{
    ERROR_INVALID_ARGUMENT, ERROR_NOT_SUPPORTED, SUCCESS, answer, is_mig_handle, with_gpu,
};

const DEFAULT: nvmlComputeMode_t = 0;
const EXCLUSIVE_THREAD: nvmlComputeMode_t = 1;
const PROHIBITED: nvmlComputeMode_t = 2;
const EXCLUSIVE_PROCESS: nvmlComputeMode_t = 3;

/// Modes set, by GPU index.
static MODES: Mutex<BTreeMap<usize, nvmlComputeMode_t>> = Mutex::new(BTreeMap::new());

fn mode_name(mode: nvmlComputeMode_t) -> &'static str {
    match mode {
        DEFAULT => "DEFAULT",
        EXCLUSIVE_THREAD => "EXCLUSIVE_THREAD",
        PROHIBITED => "PROHIBITED",
        _ => "EXCLUSIVE_PROCESS",
    }
}

fn mode_of(index: usize) -> nvmlComputeMode_t {
    MODES
        .lock()
        .unwrap_or_else(|p| p.into_inner())
        .get(&index)
        .copied()
        .unwrap_or(DEFAULT)
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetComputeMode(
    device: nvmlDevice_t,
    mode: *mut nvmlComputeMode_t,
) -> nvmlReturn_t {
    let _cost = costs::charge("nvmlDeviceGetComputeMode");
    if is_mig_handle(device) {
        return ERROR_INVALID_ARGUMENT;
    }
    // SAFETY: `mode` is the caller's out-pointer; `answer` checks for null.
    with_gpu(device, |_, i, _| unsafe { answer(mode, Some(mode_of(i))) })
}

#[unsafe(no_mangle)]
pub extern "C" fn nvmlDeviceSetComputeMode(
    device: nvmlDevice_t,
    mode: nvmlComputeMode_t,
) -> nvmlReturn_t {
    let _cost = costs::charge("nvmlDeviceSetComputeMode");
    if is_mig_handle(device) {
        return ERROR_INVALID_ARGUMENT;
    }
    match mode {
        DEFAULT | PROHIBITED | EXCLUSIVE_PROCESS => {}
        EXCLUSIVE_THREAD => return ERROR_NOT_SUPPORTED,
        _ => return ERROR_INVALID_ARGUMENT,
    }
    with_gpu(device, |node, i, _| {
        let mut modes = MODES.lock().unwrap_or_else(|p| p.into_inner());
        modes.insert(i, mode);
        if let Ok(path) = std::env::var("FAKE_NVML_COMPUTE_MODES") {
            let text: String = node
                .gpus
                .iter()
                .enumerate()
                .map(|(j, g)| {
                    let m = modes.get(&j).copied().unwrap_or(DEFAULT);
                    format!("{} {}\n", g.uuid, mode_name(m))
                })
                .collect();
            // Whole or not at all, for a test reading it meanwhile.
            let tmp = format!("{path}.tmp");
            if let Err(e) = std::fs::write(&tmp, text).and_then(|()| std::fs::rename(&tmp, &path)) {
                eprintln!("fake libnvidia-ml: {path}: {e}");
            }
        }
        SUCCESS
    })
}
