//! Dynamic Resource Allocation on the node (issue 31; docs/dra-facts.md has
//! the interfaces it must match). Not wired into the agent yet: no policy key
//! turns it on, and nothing here runs unless a caller starts it.
//!
//! - [`claim`]: what the kubelet asks about (a claim) and what a prepared
//!   claim gives back (devices and their CDI IDs); the [`claim::Claims`]
//!   trait between the gRPC side and the node's state. The bottom.
//! - [`claims`]: the node's side of claims: the transient CDI spec per
//!   claim, the device nodes it names checked, the checkpoint of prepared
//!   claims (atomic, tied to the boot, recovered when corrupt).
//! - [`kubelet`]: the kubelet's side: plugin registration and the DRA
//!   `v1` / `v1beta1` gRPC services, answering through [`claim::Claims`].

pub mod claim;
pub mod claims;
pub mod kubelet;
