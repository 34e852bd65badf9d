//! The kubelet's side of DRA: plugin registration, the DRA gRPC services
//! (`v1`, `v1beta1`) answering through [`crate::claim::Claims`], and the
//! device health stream (`v1alpha1.DRAResourceHealth`), served on the
//! kubelet's two Unix sockets (docs/dra-facts.md §2, §4, §5).
//!
//! - [`registration`]: `pluginregistration.Registration` (GetInfo,
//!   NotifyRegistrationStatus), the kubelet's verdict kept on a watch channel.
//! - [`dra`]: `NodePrepareResources` / `NodeUnprepareResources`, one entry per
//!   requested claim, for both API versions.
//! - [`health`]: `NodeWatchResources`: the node's complete DRA device list
//!   with each device's health (a MIG device's is its GPU's), at once when
//!   the kubelet opens the stream, again on every change, and refreshed
//!   within the kubelet's timeout; from the health monitor's
//!   [`HealthView`](gpu_model::health::HealthView) and
//!   [`NodeClaims::watch_devices`](crate::claims::NodeClaims::watch_devices)
//!   ([`HealthSource::from_claims`]).
//! - [`serve`]: the sockets (created, cleaned, removed) and the servers on
//!   them until a shutdown signal; the health service on the DRA socket.

pub mod dra;
pub mod health;
pub mod registration;
pub mod serve;

pub use dra::DraService;
pub use health::{HealthService, HealthSource};
pub use registration::{Registration, RegistrationService};
pub use serve::{
    DRA_SOCKET, Dirs, KUBELET_PLUGINS_DIR, KUBELET_REGISTRY_DIR, ServeError,
    registration_socket_name, serve,
};
