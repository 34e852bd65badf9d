//! gpu-agent: one privileged agent per GPU node that does the node's whole
//! GPU job. This library holds everything the `gpu-agent` binary runs; the
//! binary is the CLI around it.

pub mod caps;
pub mod logging;
pub mod policy;
pub mod render;
pub mod stages;
pub mod state;
pub mod supervisor;
pub mod uninstall;

/// The crates under `crates/`, under the module names they had in this crate.
pub use gpu_backend as backend;
pub use gpu_backend::source;
pub use gpu_cdi as cdi;
pub use gpu_driver as driver;
pub use gpu_grpc as grpc;
pub use gpu_health as health;
pub use gpu_labels as labels;
pub use gpu_metrics as metrics;
pub use gpu_mig as mig;
pub use gpu_plugin as plugin;
pub use gpu_report as report;
pub use gpu_runtime as runtime;
pub use gpu_workload as workload;

/// The one model of the node's GPUs (gpu-model's), and its discovery
/// (gpu-backend's): from sysfs, `/proc` and a GPU backend, once; every front
/// end reads it and none re-discovers.
pub mod inventory {
    pub use gpu_backend::discover::discover;
    pub use gpu_model::inventory::*;
}

#[cfg(test)]
pub(crate) use gpu_backend::test_support;

pub use inventory::Inventory;
pub use policy::Policy;
