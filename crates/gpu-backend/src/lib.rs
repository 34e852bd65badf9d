//! GPU backends: where per-GPU facts (name, UUID, memory, MIG, NVLinks,
//! readings) come from, and discovery, which joins them with sysfs and
//! `/proc` into the model's inventory.
//!
//! - [`nvml::NvmlBackend`]: the real NVIDIA Management Library through
//!   `nvml-wrapper` (in CI: against the project's fake libnvidia-ml).
//! - [`sim::SimulatedBackend`]: a node description file, for the demo and
//!   fast tests.
//! - [`source::NodeView`]: the host or a simulated node, as one pass reads it.
//! - [`discover::discover`]: the inventory of a node.
//!
//! Both backends fill the same [`BackendSnapshot`] (gpu-model's, re-exported
//! here with the rest of what a backend is and reports).

pub mod discover;
pub mod nvml;
mod nvml_identity;
mod nvml_mig;
mod nvml_sample;
pub mod sim;
pub mod source;
#[cfg(any(test, feature = "test-support"))]
pub mod test_support;

/// What a backend is and reports: the model's.
pub use gpu_model::backend::*;
