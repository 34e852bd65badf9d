//! The kubelet device plugin (API v1beta1): one gRPC server per resource on
//! its own Unix socket, registered with the kubelet and re-registered when
//! the kubelet restarts.

pub mod allocate;
pub mod kubelet;
pub mod manager;
pub mod mps;
pub mod preferred;
pub mod server;
pub mod socket;

/// The node's advertised resources (the device-plugin config, sharing, MIG
/// strategy → resources) are gpu-resources': labels describe them too.
pub use gpu_resources::{SettingsError, config, resources, settings};

#[cfg(test)]
use gpu_backend::test_support;
