//! GPU backends: where per-GPU facts (name, UUID, memory, MIG, NVLinks,
//! readings) come from.
//!
//! - [`nvml::NvmlBackend`]: the real NVIDIA Management Library through
//!   `nvml-wrapper` (in CI: against the project's fake libnvidia-ml).
//! - [`sim::SimulatedBackend`]: a node description file, for the demo and
//!   fast tests.
//!
//! Both fill the same [`BackendSnapshot`]; the inventory joins it with what
//! sysfs shows.

pub mod nvml;
mod nvml_mig;
mod nvml_sample;
pub mod sim;

/// What a backend is and reports: the model's.
pub use gpu_model::backend::*;
