//! The kubelet device plugin (API v1beta1): one gRPC server per resource on
//! its own Unix socket, registered with the kubelet and re-registered when
//! the kubelet restarts.

pub mod allocate;
pub mod config;
pub mod kubelet;
pub mod manager;
pub mod preferred;
pub mod resources;
pub mod server;

#[cfg(test)]
pub(crate) use crate::test_support;
