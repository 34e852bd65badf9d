//! A claim's MPS control daemon through the [`MpsPort`]: which GPUs it
//! serves, started before the claim's spec is written (the spec gets the
//! daemon's directories), stopped before the claim is unprepared, and
//! started again at start-up for the claims still prepared
//! ([`NodeClaims::restore_mps`]).

use std::collections::BTreeMap;

use super::NodeClaims;
use super::allocation::ClaimAllocation;
use super::cdi;
use super::checkpoint::{self, Entry, EntryState};
use super::devices::NodeDevice;
use super::error::{ClaimError, Named};
use super::sharing::{self, MpsDirs, MpsGpu};
use crate::claim::ClaimRef;

impl NodeClaims {
    /// The devices of an MPS claim's daemon (GPUs and MIG devices, each
    /// by its own UUID, as NVIDIA's driver gives its daemon), in the
    /// allocation's order; a node without MPS daemons is refused in words.
    pub(super) fn mps_gpus(
        &self,
        named: &Named,
        alloc: &ClaimAllocation,
        devices: &BTreeMap<String, NodeDevice>,
    ) -> Result<Vec<MpsGpu>, ClaimError> {
        let refuse = |why: String| ClaimError::Config {
            claim: named.clone(),
            why,
        };
        if self.mps.is_none() {
            return Err(refuse(
                "it asks for sharing with strategy MPS, and this node's DRA plugin runs without MPS control daemons".into(),
            ));
        }
        let mut out: Vec<MpsGpu> = Vec::new();
        for d in &alloc.devices {
            let Some(dev) = devices.get(&d.device) else {
                continue;
            };
            if !out.iter().any(|g| g.uuid == dev.uuid) {
                out.push(mps_gpu(dev));
            }
        }
        Ok(out)
    }

    /// Starts the daemon of `entry` (a claim being prepared, with MPS):
    /// its directories, for the spec's edits. Called without the lock.
    pub(super) fn start_mps(
        &self,
        c: &ClaimRef,
        entry: &Entry,
        gpus: &[MpsGpu],
    ) -> Result<MpsDirs, ClaimError> {
        let claim = Named::new(c.clone());
        let (Some(settings), Some(port)) = (&entry.mps, &self.mps) else {
            return Err(ClaimError::Mps {
                claim,
                why: "this node's DRA plugin runs without MPS control daemons".into(),
            });
        };
        let dirs = port
            .start(&c.uid, gpus, settings)
            .map_err(|why| ClaimError::Mps {
                claim: claim.clone(),
                why,
            })?;
        tracing::info!(claim = %claim, pipe_dir = %dirs.pipe_dir, "MPS control daemon of the claim serves");
        Ok(dirs)
    }

    /// Stops the daemon of a claim whose prepare failed after it started
    /// (a failure is logged: the claim is not prepared either way).
    pub(super) fn stop_mps_after_failure(&self, claim: &Named, entry: &Entry) {
        if let Err(e) = self.stop_mps(&claim.0, entry) {
            tracing::warn!(claim = %claim, error = %e, "the MPS control daemon of a claim that failed to prepare did not stop");
        }
    }

    /// Stops the daemon of `entry` when it has MPS.
    pub(super) fn stop_mps(&self, c: &ClaimRef, entry: &Entry) -> Result<(), ClaimError> {
        let (Some(_), Some(port)) = (&entry.mps, &self.mps) else {
            return Ok(());
        };
        port.stop(&c.uid).map_err(|why| ClaimError::Mps {
            claim: Named::new(c.clone()),
            why,
        })
    }

    /// Starts the daemons of the claims still prepared (after
    /// [`NodeClaims::open_with_mps`]: the kubelet does not prepare running
    /// pods' claims again). Blocks until each serves or fails; what fails
    /// is a problem in `status`'s recovery. Returns the claims whose daemon
    /// serves.
    pub fn restore_mps(&self) -> Vec<String> {
        let Some(port) = self.mps.clone() else {
            return Vec::new();
        };
        // Started outside the lock: the kubelet's calls go on meanwhile.
        let (wanted, devices, unfinished) = {
            let mut st = self.lock();
            // One prepared again since is not touched.
            let unfinished: Vec<(String, Entry)> = std::mem::take(&mut st.unfinished_mps)
                .into_iter()
                .filter(|(u, _)| !st.checkpoint.claims.contains_key(u))
                .collect();
            let wanted: Vec<(String, Entry)> = st
                .checkpoint
                .claims
                .iter()
                .filter(|(_, e)| e.state == EntryState::Prepared && e.mps.is_some())
                .map(|(u, e)| (u.clone(), e.clone()))
                .collect();
            (wanted, st.devices.clone(), unfinished)
        };
        let mut problems: Vec<String> = Vec::new();
        // A prepare cut short (the agent killed) may have left its daemon
        // running, its GPUs in EXCLUSIVE_PROCESS: a start tells whatever
        // serves on the claim's pipe directory to quit, the stop ends ours
        // and puts the GPUs back to DEFAULT.
        for (uid, entry) in unfinished {
            let claim = Named::new(entry.claim_ref(&uid));
            let gpus = gpus_of(&entry, &devices).unwrap_or_default();
            let _ = port.start(&uid, &gpus, &entry.mps.clone().unwrap_or_default());
            match port.stop(&uid) {
                Ok(()) => {
                    tracing::info!(claim = %claim, "MPS control daemon of an unfinished prepare stopped")
                }
                Err(why) => problems.push(format!(
                    "the MPS control daemon of {claim}, whose prepare never finished, did not stop: {why}"
                )),
            }
        }
        let mut served: Vec<(String, Named, MpsDirs)> = Vec::new();
        for (uid, entry) in wanted {
            let claim = Named::new(entry.claim_ref(&uid));
            let started = gpus_of(&entry, &devices)
                .and_then(|gpus| port.start(&uid, &gpus, &entry.mps.clone().unwrap_or_default()));
            match started {
                Ok(dirs) => served.push((uid, claim, dirs)),
                Err(why) => {
                    tracing::warn!(claim = %claim, error = %why, "MPS control daemon not started again");
                    problems.push(format!(
                        "the MPS control daemon of {claim} was not started again: {why}"
                    ));
                }
            }
        }
        let mut st = self.lock();
        let mut restarted = Vec::new();
        let mut changed = false;
        for (uid, claim, dirs) in served {
            let Some(e) = st.checkpoint.claims.get_mut(&uid) else {
                // Unprepared meanwhile (its stop came after this start).
                continue;
            };
            let before = e.spec.clone();
            set_edits(&mut e.spec, &dirs);
            if e.spec != before {
                let path = cdi::spec_path(&self.opts.cdi_dir, &uid);
                let yaml = cdi::to_yaml(&e.spec);
                if let Err(err) = self.host.write_atomic(&path, yaml.as_bytes(), 0o644) {
                    problems.push(format!("writing {path}: {err}"));
                }
                changed = true;
            }
            tracing::info!(claim = %claim, "MPS control daemon of a prepared claim started again");
            restarted.push(uid);
        }
        if changed {
            let path = checkpoint::checkpoint_path(&self.opts.state_dir);
            if let Err(e) = checkpoint::save(&self.host, &path, &st.checkpoint) {
                problems.push(e.to_string());
            }
        }
        st.recovery.problems.extend(problems);
        st.recovery.mps_restarted = restarted.clone();
        restarted
    }
}

/// The GPUs of a claim's daemon, from its entry's devices; `Err` names
/// those not on this node now.
fn gpus_of(entry: &Entry, devices: &BTreeMap<String, NodeDevice>) -> Result<Vec<MpsGpu>, String> {
    let mut gpus: Vec<MpsGpu> = Vec::new();
    let mut unknown = Vec::new();
    for d in &entry.devices {
        match devices.get(&d.device) {
            Some(dev) if !gpus.iter().any(|g| g.uuid == dev.uuid) => gpus.push(mps_gpu(dev)),
            Some(_) => {}
            None => unknown.push(d.device.clone()),
        }
    }
    if unknown.is_empty() {
        Ok(gpus)
    } else {
        Err(format!(
            "its devices {} are not on this node now",
            unknown.join(", ")
        ))
    }
}

/// A device of a claim's daemon.
fn mps_gpu(dev: &NodeDevice) -> MpsGpu {
    MpsGpu {
        uuid: dev.uuid.clone(),
        minor: dev.minor,
        gpu_uuid: dev.gpu_uuid.clone(),
    }
}

/// Gives every device of `spec` the edits of a daemon at `dirs`, in place
/// of those of an earlier daemon of the claim.
pub(crate) fn set_edits(spec: &mut gpu_model::cdi::Spec, dirs: &MpsDirs) {
    let edits = sharing::container_edits(dirs);
    for d in &mut spec.devices {
        let e = &mut d.container_edits;
        e.env.retain(|v| !v.starts_with("CUDA_MPS_PIPE_DIRECTORY="));
        e.mounts.retain(|m| {
            m.container_path != sharing::CONTAINER_PIPE_DIR
                && m.container_path != sharing::CONTAINER_SHM_DIR
        });
        sharing::add_edits(e, &edits);
    }
}
