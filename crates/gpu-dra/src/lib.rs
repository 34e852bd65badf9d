//! Dynamic Resource Allocation on the node (issue 31; docs/dra-facts.md has
//! the interfaces it must match). The agent runs it when the policy's
//! `spec.dra.enabled` is true.
//!
//! - [`claim`]: what the kubelet asks about (a claim) and what a prepared
//!   claim gives back (devices and their CDI IDs); the [`claim::Claims`]
//!   trait between the gRPC side and the node's state. The bottom.
//! - [`claims`]: the node's side of claims: the transient CDI spec per
//!   claim, the device nodes it names checked, the checkpoint of prepared
//!   claims (atomic, tied to the boot, recovered when corrupt).
//! - [`spec`]: the policy's `spec.dra`, and which GPUs it gives DRA (the
//!   device plugin keeps the others).
//! - [`kubelet`]: the kubelet's side: plugin registration, the DRA
//!   `v1` / `v1beta1` gRPC services answering through [`claim::Claims`], and
//!   the device health stream (`v1alpha1.DRAResourceHealth`): the complete
//!   device list with each device's health from the health monitor.

pub mod claim;
pub mod claims;
pub mod kubelet;
pub mod spec;
