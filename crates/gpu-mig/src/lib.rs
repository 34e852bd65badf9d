//! MIG layouts: mig-parted's config applied through NVML.
//!
//! [`plan`] compares what the selected layout wants of each GPU with what
//! NVML says the GPU has, and checks that the wanted instances fit (profile
//! known to the GPU, instance counts, placements) before anything changes.
//! [`apply`] carries a plan out: MIG mode (with a GPU reset through the PCI
//! function's sysfs `reset` when the mode stays pending), then the GPU
//! instances and compute instances, then a check; any failure puts back the
//! layout every changed GPU had. A GPU whose layout already matches is not
//! touched.

pub mod config;
pub mod derive;
pub mod spec;
#[cfg(test)]
mod tests;
#[cfg(test)]
use gpu_backend::test_support;

mod applier;
mod holders;
mod layout;
mod planner;
mod status;

pub use applier::{APPLY_FAILED, Applied, ApplyEnv, ApplyError, apply, apply_failed};
/// What MIG is to NVML (the [`MigControl`] trait the backends implement, its
/// types) and the placement search are the model's.
pub use gpu_model::mig::{
    CiProfile, ComputeInstance, ErrorKind, GiProfile, GpuInstance, MigControl, MigError, Mode,
    Placement, place,
};
pub use holders::{Holder, holders, holders_message, wait_for_holders};
pub use layout::{GpuLayout, WantedGi};
pub use planner::{GpuPlan, Plan, PlanError, grouped, load_config, plan, selected};
pub use status::{MigConfigState, MigStatus};
