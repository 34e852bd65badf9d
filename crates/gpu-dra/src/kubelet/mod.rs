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
pub use serve::{
    DRA_SOCKET, Dirs, KUBELET_PLUGINS_DIR, KUBELET_REGISTRY_DIR, ServeError,
    registration_socket_name, serve,
};
