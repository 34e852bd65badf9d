//! gpu-agent: one privileged agent per GPU node that does the node's whole
//! GPU job. This library holds everything the `gpu-agent` binary runs; the
//! binary is the CLI around it.

pub mod backend;
pub mod caps;
pub mod cdi;
pub mod driver;
pub mod health;
pub mod inventory;
pub mod labels;
pub mod logging;
pub mod metrics;
pub mod mig;
pub mod plugin;
pub mod policy;
pub mod render;
pub mod report;
pub mod runtime;
pub mod source;
pub mod stages;
pub mod state;
pub mod supervisor;
#[cfg(test)]
pub(crate) mod test_support;
pub mod uninstall;
pub mod workload;

/// The crates under `crates/`, under the module names they had in this crate.
pub use gpu_grpc as grpc;

pub use inventory::Inventory;
pub use policy::Policy;
