//! A node's Dynamic Resource Allocation objects (issue 31, docs/dra-facts.md
//! §6–7): the ResourceSlices of its GPUs and MIG devices from its agent's
//! report, the DeviceClasses, and the RBAC rules for writing them. Pure.
//!
//! - [`facts`]: what the builder needs of a node's devices, and what the
//!   report carries of it ([`facts::NodeDevices::from_report`]);
//! - [`names`]: device names, semver and Quantity spellings as the API and
//!   NVIDIA's driver have them;
//! - [`slices`]: devices, their attributes, capacities and taints, split into
//!   the pool's slices;
//! - [`classes`]: the DeviceClasses and the RBAC rules, as data.
//! - [`claims`]: which node a ResourceClaim of ours is on, and what its
//!   agent is handed of it for prepare.

pub mod claims;
pub mod classes;
pub mod facts;
pub mod names;
pub mod slices;

#[cfg(test)]
mod tests;

pub use classes::{device_classes, rbac_rules};
pub use facts::{DeviceHealth, GpuFacts, MigFacts, NodeDevices};
pub use names::DRIVER;
pub use slices::{LeftOut, devices, next_generation, resource_slices, slices, unchanged};
