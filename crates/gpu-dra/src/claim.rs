//! What the kubelet asks about and what a prepared claim gives back: plain
//! types and the [`Claims`] trait the gRPC services answer through. Below
//! both the node's claim state (`claims`) and the kubelet side (`kubelet`).

use std::collections::BTreeMap;

/// The DRA driver name: NVIDIA's (docs/dra-facts.md §2), so claims written
/// for NVIDIA's driver work unchanged.
pub const DRIVER_NAME: &str = "gpu.nvidia.com";

/// A ResourceClaim as the kubelet names it in `NodePrepareResources` /
/// `NodeUnprepareResources`.
#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct ClaimRef {
    pub namespace: String,
    pub uid: String,
    pub name: String,
}

/// One device of a prepared claim, as the kubelet stores it and hands its
/// CDI IDs to the runtime for the containers whose request it serves.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PreparedDevice {
    /// The claim's requests this device serves (empty: all).
    pub request_names: Vec<String>,
    /// The ResourceSlice pool (the node's name).
    pub pool_name: String,
    /// The device's name in the pool (`gpu-0`, a MIG device's name).
    pub device_name: String,
    /// Fully qualified CDI device IDs (`k8s.gpu.nvidia.com/claim=<uid>-gpu-0`).
    pub cdi_device_ids: Vec<String>,
    /// The allocation's share ID, when the device is shared (DRA v1 only).
    pub share_id: Option<String>,
}

/// What preparing one claim came to: its devices, or why it failed, in words
/// that name the claim and what is missing (the kubelet shows them on the pod).
pub type PrepareOutcome = Result<Vec<PreparedDevice>, String>;

/// The node's claims, as the DRA services see them. Both calls take a batch
/// (one pod's claims) and answer for every claim in it, keyed by UID; both are
/// idempotent (a repeat answers as the first did) and safe when a prepare and
/// its unprepare race or repeat.
pub trait Claims: Send + Sync + 'static {
    /// Prepares each claim: one outcome per claim UID of `claims`.
    fn prepare(&self, claims: &[ClaimRef]) -> BTreeMap<String, PrepareOutcome>;
    /// Undoes each claim's prepare (an unknown claim is done already):
    /// `Ok(())` or why not, per claim UID of `claims`.
    fn unprepare(&self, claims: &[ClaimRef]) -> BTreeMap<String, Result<(), String>>;
}
