//! Time-slicing of a claim's GPUs at an interval other than the GPU's
//! default, as NVIDIA's DRA driver does it (`cmd/gpu-kubelet-plugin`,
//! `SetTimeSlice`): each full GPU of the claim is put in the DEFAULT
//! compute mode, then its time slice is set (`nvidia-smi compute-policy
//! --set-timeslice <n>`, `Default` 0, `Short` 1, `Medium` 2, `Long` 3);
//! unprepare sets it back to `Default`. MIG devices take no time slice.
//!
//! Who changes the GPUs is the [`TimeSlicePort`](super::TimeSlicePort) the agent hands to
//! [`NodeClaims`](super::NodeClaims); what was asked is recorded in the
//! checkpoint ([`Checkpoint::time_slices`](super::Checkpoint)) before the
//! GPUs change, so that a prepare cut short is undone at start
//! ([`NodeClaims::restore_time_slices`]).

use std::collections::BTreeMap;

use super::NodeClaims;
use super::allocation::ClaimAllocation;
use super::checkpoint::Checkpoint;
use super::devices::NodeDevice;
use super::error::{ClaimError, Named};
use super::interval::{TimeSliceInterval, TimeSliceRecord};
use crate::claim::ClaimRef;

impl NodeClaims {
    /// What a claim with time-slicing at `interval` records: its full GPUs.
    /// A non-`Default` interval is refused in words on MIG devices and on a
    /// node without a port.
    pub(super) fn time_slice_plan(
        &self,
        named: &Named,
        alloc: &ClaimAllocation,
        devices: &BTreeMap<String, NodeDevice>,
        interval: TimeSliceInterval,
    ) -> Result<Option<TimeSliceRecord>, ClaimError> {
        let refuse = |why: String| ClaimError::Config {
            claim: named.clone(),
            why,
        };
        let changes = interval != TimeSliceInterval::Default;
        if changes && let Err(why) = &self.time_slice {
            return Err(refuse(format!(
                "it asks for time-slicing with interval {interval}, which changes the GPU's time slice; {why}"
            )));
        }
        let mut gpus: Vec<String> = Vec::new();
        for d in &alloc.devices {
            let Some(dev) = devices.get(&d.device) else {
                continue;
            };
            if dev.uuid != dev.gpu_uuid {
                if changes {
                    return Err(refuse(format!(
                        "it asks for time-slicing with interval {interval} on {}, a MIG device, which takes no time slice (only full GPUs do): use interval Default",
                        d.device
                    )));
                }
                continue;
            }
            if !gpus.contains(&dev.uuid) {
                gpus.push(dev.uuid.clone());
            }
        }
        if gpus.is_empty() {
            return Ok(None);
        }
        Ok(Some(TimeSliceRecord { interval, gpus }))
    }

    /// Changes the GPUs of a claim being prepared (called without the lock).
    pub(super) fn apply_time_slice(
        &self,
        c: &ClaimRef,
        rec: &TimeSliceRecord,
    ) -> Result<(), ClaimError> {
        let claim = Named::new(c.clone());
        let port = match &self.time_slice {
            Ok(p) => p,
            Err(why) => {
                return Err(ClaimError::TimeSlice {
                    claim,
                    why: why.clone(),
                });
            }
        };
        port.set_time_slice(&rec.gpus, rec.interval)
            .map_err(|why| ClaimError::TimeSlice {
                claim: claim.clone(),
                why,
            })?;
        tracing::info!(claim = %claim, gpus = ?rec.gpus, interval = %rec.interval, "time slice of the claim's GPUs set");
        Ok(())
    }

    /// Sets the GPUs of `rec` (claim `uid`'s, whose record is gone from
    /// `ckpt` or is skipped) back to `Default`, but for those another
    /// claim of `ckpt` holds with a non-`Default` interval.
    pub(super) fn reset_time_slice(
        &self,
        ckpt: &Checkpoint,
        uid: &str,
        claim: &Named,
        rec: &TimeSliceRecord,
    ) -> Result<(), ClaimError> {
        if rec.interval == TimeSliceInterval::Default {
            return Ok(());
        }
        let Ok(port) = &self.time_slice else {
            return Ok(());
        };
        let mut gpus = Vec::new();
        for g in &rec.gpus {
            let holder = ckpt.time_slices.iter().find(|(u, r)| {
                u.as_str() != uid && r.interval != TimeSliceInterval::Default && r.gpus.contains(g)
            });
            match holder {
                Some((other, r)) => {
                    tracing::debug!(claim = %claim, gpu = %g, other = %other, interval = %r.interval, "the GPU's time slice is kept: another claim holds it")
                }
                None => gpus.push(g.clone()),
            }
        }
        if gpus.is_empty() {
            return Ok(());
        }
        port.set_time_slice(&gpus, TimeSliceInterval::Default)
            .map_err(|why| ClaimError::TimeSlice {
                claim: claim.clone(),
                why,
            })?;
        tracing::info!(claim = %claim, gpus = ?gpus, "time slice of the claim's GPUs set back to Default");
        Ok(())
    }

    /// Resets a claim's GPUs after its prepare failed (a failure is logged:
    /// the claim is not prepared either way).
    pub(super) fn reset_after_failure(
        &self,
        ckpt: &Checkpoint,
        uid: &str,
        claim: &Named,
        rec: &TimeSliceRecord,
    ) {
        if let Err(e) = self.reset_time_slice(ckpt, uid, claim, rec) {
            tracing::warn!(claim = %claim, error = %e, "the time slice of a claim that failed to prepare was not set back");
        }
    }

    /// At start (after [`NodeClaims::open_with_mps`]): the GPUs of claims
    /// whose prepare never finished (rolled back at start) are set back to
    /// `Default`, and their records dropped. Blocks; what fails is a
    /// problem in `status`'s recovery and is tried again at the next start.
    /// Returns the claims whose GPUs were set back (none without a port:
    /// the records are kept).
    pub fn restore_time_slices(&self) -> Vec<String> {
        if self.time_slice.is_err() {
            // Nothing can set them back here: the records wait.
            return Vec::new();
        }
        let mut st = self.lock();
        let stale: Vec<(String, TimeSliceRecord)> = st
            .checkpoint
            .time_slices
            .iter()
            .filter(|(u, _)| !st.checkpoint.claims.contains_key(*u))
            .map(|(u, r)| (u.clone(), r.clone()))
            .collect();
        if stale.is_empty() {
            return Vec::new();
        }
        let mut reset = Vec::new();
        let mut problems = Vec::new();
        for (uid, rec) in stale {
            let named = Named::new(ClaimRef {
                namespace: String::new(),
                uid: uid.clone(),
                name: String::new(),
            });
            let mut without = st.checkpoint.clone();
            without.time_slices.remove(&uid);
            match self.reset_time_slice(&without, &uid, &named, &rec) {
                Ok(()) => {
                    st.checkpoint.time_slices.remove(&uid);
                    reset.push(uid);
                }
                Err(e) => problems.push(format!(
                    "the time slice of claim {uid}, whose prepare never finished, was not set back: {e}"
                )),
            }
        }
        if !reset.is_empty() {
            let path = super::checkpoint::checkpoint_path(&self.opts.state_dir);
            if let Err(e) = super::checkpoint::save(&self.host, &path, &st.checkpoint) {
                problems.push(e.to_string());
            }
        }
        st.recovery.problems.extend(problems);
        reset
    }
}

/// Another claim (of `others`) that holds one of `rec`'s GPUs with another
/// interval: `(its uid, the GPU, its interval)`.
pub(super) fn conflict<'a>(
    rec: &TimeSliceRecord,
    others: impl Iterator<Item = (&'a str, &'a TimeSliceRecord)>,
) -> Option<(&'a str, String, TimeSliceInterval)> {
    for (uid, r) in others {
        if r.interval == rec.interval {
            continue;
        }
        if let Some(g) = rec.gpus.iter().find(|g| r.gpus.contains(g)) {
            return Some((uid, g.clone(), r.interval));
        }
    }
    None
}
