//! The node's side of claims: [`NodeClaims`], the [`Claims`] the kubelet
//! side answers through. Per claim: the allocation the controller handed
//! over ([`allocation`]), the devices named as NVIDIA's driver names them
//! ([`devices`]), a transient CDI spec built from the node's own spec with
//! its device nodes checked ([`cdi`]), and the checkpoint of prepared claims
//! ([`checkpoint`]), tied to the boot and reconciled on start ([`recovery`]).
//!
//! Every change to the node's claims happens under one mutex and makes no
//! API call; only the wait for an allocation that has not arrived yet is
//! outside it, so one slow claim does not hold up the others.

pub mod allocation;
pub mod cdi;
pub mod checkpoint;
pub mod config;
pub mod devices;
pub mod error;
pub mod feed;
pub mod interval;
mod mps;
pub mod options;
mod prepare;
pub mod recovery;
pub mod sharing;
pub mod timeslice;

#[cfg(test)]
mod tests;
#[cfg(test)]
mod tests_mps;
#[cfg(test)]
pub(crate) mod tests_support;
#[cfg(test)]
mod tests_timeslice;

use std::collections::{BTreeMap, BTreeSet};
use std::sync::{Arc, Mutex, MutexGuard};

use gpu_model::inventory::Inventory;
use hostlib::HostRoot;
use serde::Serialize;
use tokio::sync::watch;

use crate::claim::{ClaimRef, Claims, PrepareOutcome};

pub use allocation::{
    AllocatedDevice, Allocations, ClaimAllocation, ConfigSource, MemoryAllocations, OpaqueConfig,
};
pub use checkpoint::{Checkpoint, EntryState};
pub use devices::NodeDevice;
pub use error::{ClaimError, StateError};
pub use interval::{TimeSliceInterval, TimeSlicePort, TimeSliceRecord};
pub use options::{DEFAULT_ALLOCATION_WAIT, DEFAULT_CDI_DIR, DEFAULT_STATE_DIR, Options};
pub use recovery::Recovery;
pub use sharing::{MpsDirs, MpsGpu, MpsPort, MpsSettings};

/// Why claims with a non-`Default` time-slicing interval are refused when
/// no [`TimeSlicePort`] was given.
const NO_TIME_SLICE: &str = "this node's DRA plugin runs without a way to change GPU time slices";

/// The node's claims (see the module docs).
pub struct NodeClaims {
    host: HostRoot,
    opts: Options,
    allocations: Arc<dyn Allocations>,
    /// Who runs MPS daemons for claims that ask for MPS (none: refused).
    mps: Option<Arc<dyn MpsPort>>,
    /// Who changes the GPUs' time slices, or why this node does not
    /// (claims with a non-`Default` interval are refused).
    time_slice: Result<Arc<dyn TimeSlicePort>, String>,
    state: Mutex<State>,
    /// The device table, for those who follow it (the health stream); sent
    /// under the state's lock, only when it changed.
    devices_tx: watch::Sender<BTreeMap<String, NodeDevice>>,
}

/// What the mutex guards.
#[derive(Debug)]
struct State {
    checkpoint: Checkpoint,
    devices: BTreeMap<String, NodeDevice>,
    recovery: Recovery,
    /// Claims with MPS whose prepare never finished (rolled back at start):
    /// a daemon an agent killed meanwhile left is stopped by
    /// [`NodeClaims::restore_mps`].
    unfinished_mps: Vec<(String, checkpoint::Entry)>,
    /// Prepares waiting for allocations outside the lock, by ticket.
    waiting: BTreeMap<u64, Waiter>,
    next_ticket: u64,
}

/// A prepare's claims while it waits outside the lock, and those of them
/// an unprepare has come for meanwhile: those are not prepared after all.
#[derive(Debug, Default)]
struct Waiter {
    uids: BTreeSet<String>,
    unprepared: BTreeSet<String>,
}

impl std::fmt::Debug for NodeClaims {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("NodeClaims")
            .field("opts", &self.opts)
            .field("state", &self.state)
            .finish_non_exhaustive()
    }
}

/// One claim as `status` shows it.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct ClaimStatus {
    pub uid: String,
    pub namespace: String,
    pub name: String,
    pub state: EntryState,
    pub devices: Vec<String>,
    /// Its GPUs are shared through an MPS control daemon.
    pub mps: bool,
}

/// What the agent shows of its claims.
#[derive(Clone, Debug, PartialEq, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct Status {
    /// What start-up found and did.
    pub recovery: Recovery,
    pub claims: Vec<ClaimStatus>,
}

impl NodeClaims {
    /// Opens the node's claims: reads the boot ID and the checkpoint,
    /// reconciles them with the spec files present ([`recovery::recover`]),
    /// and names the devices of `inv`.
    pub fn open(
        host: HostRoot,
        opts: Options,
        allocations: Arc<dyn Allocations>,
        inv: &Inventory,
    ) -> Result<Self, StateError> {
        Self::open_with_mps(host, opts, allocations, inv, None)
    }

    /// [`open`](Self::open), with `mps` running the MPS daemons of claims
    /// that ask for MPS sharing (`None`: those claims are refused). The
    /// daemons of claims still prepared are started by
    /// [`restore_mps`](Self::restore_mps), which blocks: call it off the
    /// async threads.
    pub fn open_with_mps(
        host: HostRoot,
        opts: Options,
        allocations: Arc<dyn Allocations>,
        inv: &Inventory,
        mps: Option<Arc<dyn MpsPort>>,
    ) -> Result<Self, StateError> {
        let boot_id = checkpoint::read_boot_id(&host)?;
        let unfinished_mps = match &mps {
            Some(_) => recovery::unfinished_mps(&host, &opts, &boot_id),
            None => Vec::new(),
        };
        let (checkpoint, recovery) = recovery::recover(&host, &opts, &boot_id)?;
        let table = devices::device_table(inv);
        Ok(NodeClaims {
            host,
            opts,
            allocations,
            mps,
            time_slice: Err(NO_TIME_SLICE.into()),
            devices_tx: watch::Sender::new(table.clone()),
            state: Mutex::new(State {
                checkpoint,
                devices: table,
                recovery,
                waiting: BTreeMap::new(),
                next_ticket: 0,
                unfinished_mps,
            }),
        })
    }

    /// Changes the GPUs' time slices of claims that ask for an interval
    /// other than `Default` through `port` (`Err`: why this node does not;
    /// those claims are refused with it). Before the claims are served:
    /// then [`restore_time_slices`](Self::restore_time_slices), which
    /// blocks, sets back those of prepares cut short.
    pub fn with_time_slice(mut self, port: Result<Arc<dyn TimeSlicePort>, String>) -> Self {
        self.time_slice = port;
        self
    }

    fn lock(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Names the devices of a new inventory (prepared claims keep theirs).
    pub fn set_inventory(&self, inv: &Inventory) {
        let table = devices::device_table(inv);
        let mut st = self.lock();
        self.devices_tx.send_if_modified(|t| {
            let changed = *t != table;
            if changed {
                *t = table.clone();
            }
            changed
        });
        st.devices = table;
    }

    /// The device table (name → device), told again each time
    /// [`set_inventory`](Self::set_inventory) changes it: what the health
    /// stream reports on.
    pub fn watch_devices(&self) -> watch::Receiver<BTreeMap<String, NodeDevice>> {
        self.devices_tx.subscribe()
    }

    /// The node's name: the pool of its devices.
    pub fn node_name(&self) -> &str {
        &self.opts.node_name
    }

    /// The device names prepare accepts now.
    pub fn device_names(&self) -> Vec<String> {
        self.lock().devices.keys().cloned().collect()
    }

    /// What start-up found, and the claims now.
    pub fn status(&self) -> Status {
        let st = self.lock();
        Status {
            recovery: st.recovery.clone(),
            claims: st
                .checkpoint
                .claims
                .iter()
                .map(|(uid, e)| ClaimStatus {
                    uid: uid.clone(),
                    namespace: e.namespace.clone(),
                    name: e.name.clone(),
                    state: e.state,
                    devices: e.devices.iter().map(|d| d.device.clone()).collect(),
                    mps: e.mps.is_some(),
                })
                .collect(),
        }
    }
}

impl Claims for NodeClaims {
    fn prepare(&self, claims: &[ClaimRef]) -> BTreeMap<String, PrepareOutcome> {
        self.prepare_batch(claims)
            .into_iter()
            .map(|(uid, r)| (uid, r.map_err(|e| e.to_string())))
            .collect()
    }

    fn unprepare(&self, claims: &[ClaimRef]) -> BTreeMap<String, Result<(), String>> {
        self.unprepare_batch(claims)
            .into_iter()
            .map(|(uid, r)| (uid, r.map_err(|e| e.to_string())))
            .collect()
    }
}
