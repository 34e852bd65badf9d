//! Why a claim could not be prepared or unprepared, and why the claims'
//! state could not be opened: each error names the claim, file or device.

use std::fmt;

use crate::claim::ClaimRef;

/// A claim as messages name it: `ResourceClaim ns/name (uid)` (boxed:
/// errors stay small).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Named(pub Box<ClaimRef>);

impl Named {
    pub fn new(claim: ClaimRef) -> Self {
        Named(Box::new(claim))
    }
}

impl fmt::Display for Named {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let c = &self.0;
        if c.namespace.is_empty() && c.name.is_empty() {
            write!(f, "ResourceClaim {}", c.uid)
        } else {
            write!(f, "ResourceClaim {}/{} ({})", c.namespace, c.name, c.uid)
        }
    }
}

/// Why one claim failed; the kubelet shows the text on the pod.
#[derive(Debug, thiserror::Error)]
pub enum ClaimError {
    #[error("{claim}: no allocation from gpu-controller yet (waited {waited_s} s)")]
    NoAllocation { claim: Named, waited_s: u64 },
    #[error("{claim}: unprepared while this prepare waited for its allocation")]
    Unprepared { claim: Named },
    #[error("{claim}: the allocation has no device of driver gpu.nvidia.com")]
    NoDevices { claim: Named },
    #[error("{claim}: device {device} is in pool {pool}, not this node's ({node})")]
    ForeignPool {
        claim: Named,
        device: String,
        pool: String,
        node: String,
    },
    #[error("{claim}: device {device} is not on this node (devices here: {known})")]
    UnknownDevice {
        claim: Named,
        device: String,
        known: String,
    },
    #[error("{claim}: device {device} is already prepared for {other}")]
    DeviceInUse {
        claim: Named,
        device: String,
        other: Named,
    },
    #[error("{claim}: {why}")]
    Config { claim: Named, why: String },
    #[error("{claim}: the node's CDI spec {path}: {why}")]
    NodeSpec {
        claim: Named,
        path: String,
        why: String,
    },
    #[error("{claim}: device nodes missing on the host: {}", missing.join(", "))]
    MissingDeviceNodes { claim: Named, missing: Vec<String> },
    #[error("{claim}: writing {path}: {source}")]
    WriteSpec {
        claim: Named,
        path: String,
        #[source]
        source: hostlib::HostError,
    },
    #[error("{claim}: removing {path}: {source}")]
    RemoveSpec {
        claim: Named,
        path: String,
        #[source]
        source: hostlib::HostError,
    },
    #[error("{claim}: the time slice of its GPUs: {why}")]
    TimeSlice { claim: Named, why: String },
    #[error(
        "{claim}: its time-slicing interval {interval} differs from {other}'s ({other_interval}) on GPU {gpu}, which has one time slice"
    )]
    TimeSliceConflict {
        claim: Named,
        interval: String,
        other: Named,
        other_interval: String,
        gpu: String,
    },
    #[error("{claim}: its MPS control daemon: {why}")]
    Mps { claim: Named, why: String },
    #[error("{claim}: the checkpoint {path} could not be written: {why}")]
    Checkpoint {
        claim: Named,
        path: String,
        why: String,
    },
}

/// The claims' own state (checkpoint, boot ID) could not be read or written.
#[derive(Debug, thiserror::Error)]
pub enum StateError {
    #[error("reading the boot ID {path}: {source}")]
    BootId {
        path: &'static str,
        #[source]
        source: hostlib::HostError,
    },
    #[error("writing the checkpoint {path}: {source}")]
    WriteCheckpoint {
        path: String,
        #[source]
        source: hostlib::HostError,
    },
    #[error("reading the checkpoint {path}: {source}")]
    ReadCheckpoint {
        path: String,
        #[source]
        source: hostlib::HostError,
    },
    #[error("setting the corrupt checkpoint {path} aside as {aside}: {source}")]
    SetAside {
        path: String,
        aside: String,
        #[source]
        source: std::io::Error,
    },
    #[error("listing the CDI directory {path}: {source}")]
    ListSpecs {
        path: String,
        #[source]
        source: hostlib::HostError,
    },
}
