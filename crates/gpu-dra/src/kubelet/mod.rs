//! The kubelet's side of DRA: plugin registration and the DRA gRPC services
//! (`v1`, `v1beta1`), served on the kubelet's two Unix sockets and answering
//! through [`crate::claim::Claims`] (docs/dra-facts.md §2, §4).
//!
//! - [`registration`]: `pluginregistration.Registration` (GetInfo,
//!   NotifyRegistrationStatus), the kubelet's verdict kept on a watch channel.
//! - [`dra`]: `NodePrepareResources` / `NodeUnprepareResources`, one entry per
//!   requested claim, for both API versions.
//! - [`serve`]: the sockets (created, cleaned, removed) and the servers on
//!   them until a shutdown signal.

pub mod dra;
pub mod registration;
pub mod serve;

pub use dra::DraService;
pub use registration::{Registration, RegistrationService};
pub use serve::{Dirs, ServeError, serve};

/// Where the kubelet watches for plugin registration sockets (its default
/// `--root-dir` of `/var/lib/kubelet`).
pub const KUBELET_REGISTRY_DIR: &str = "/var/lib/kubelet/plugins_registry";
/// Where plugins keep their own sockets, one directory per driver.
pub const KUBELET_PLUGINS_DIR: &str = "/var/lib/kubelet/plugins";
/// The DRA socket's name in the driver's plugin directory.
pub const DRA_SOCKET: &str = "dra.sock";

/// The registration socket's name in the registry directory:
/// `<driver>-reg.sock`.
pub fn registration_socket_name() -> String {
    format!("{}-reg.sock", crate::claim::DRIVER_NAME)
}
