//! Prepare and unprepare of a batch of claims under the one mutex: a repeat
//! answers from the checkpoint, a new claim is checked (allocation, pool,
//! devices free, configs, device nodes) and its spec written between a
//! `preparing` and a `prepared` checkpoint; unprepare cleans whatever is there.

use std::collections::{BTreeMap, BTreeSet};
use std::time::Instant;

use gpu_model::cdi::Spec;

use super::allocation::ClaimAllocation;
use super::cdi;
use super::checkpoint::{self, Checkpoint, Entry, EntryDevice, EntryState};
use super::config::{self, Sharing};
use super::error::{ClaimError, Named};
use super::interval::{TimeSliceInterval, TimeSliceRecord};
use super::sharing::{MpsDirs, MpsGpu};
use super::timeslice;
use super::{NodeClaims, State, Waiter};
use crate::claim::{ClaimRef, PreparedDevice};

/// A claim checked and ready to write.
struct Plan {
    uid: String,
    entry: Entry,
    /// Its MPS daemon's GPUs, in the allocation's order (none: no MPS).
    mps_gpus: Vec<MpsGpu>,
    /// Its time-slicing on full GPUs (none: no time-slicing).
    time_slice: Option<TimeSliceRecord>,
}

impl Plan {
    /// Its GPUs' time slice changes (an interval other than `Default`).
    fn slices(&self) -> Option<&TimeSliceRecord> {
        self.time_slice
            .as_ref()
            .filter(|r| r.interval != TimeSliceInterval::Default)
    }
}

/// What was done outside the lock, by claim UID.
#[derive(Default)]
struct Outside {
    started: BTreeMap<String, Result<MpsDirs, ClaimError>>,
    sliced: BTreeMap<String, Result<(), ClaimError>>,
}

/// The node spec, read once per batch and only when a claim needs it.
enum NodeSpec {
    Unread,
    Read(Result<Spec, String>),
}

impl NodeClaims {
    pub(super) fn prepare_batch(
        &self,
        claims: &[ClaimRef],
    ) -> BTreeMap<String, Result<Vec<PreparedDevice>, ClaimError>> {
        // Allocations of the claims not already prepared, waited for
        // outside the lock, within one deadline for the whole batch.
        let (ticket, done): (u64, BTreeSet<String>) = {
            let mut st = self.lock();
            let ticket = st.next_ticket;
            st.next_ticket += 1;
            let waiter = Waiter {
                uids: claims.iter().map(|c| c.uid.clone()).collect(),
                unprepared: BTreeSet::new(),
            };
            st.waiting.insert(ticket, waiter);
            let done = claims
                .iter()
                .filter(|c| {
                    st.checkpoint
                        .claims
                        .get(&c.uid)
                        .is_some_and(|e| e.state == EntryState::Prepared && !e.recovered)
                })
                .map(|c| c.uid.clone())
                .collect();
            (ticket, done)
        };
        let deadline = Instant::now() + self.opts.allocation_wait;
        let mut allocations: BTreeMap<String, Option<ClaimAllocation>> = BTreeMap::new();
        for c in claims.iter().filter(|c| !done.contains(&c.uid)) {
            if cdi::valid_uid(&c.uid) && !allocations.contains_key(&c.uid) {
                allocations.insert(c.uid.clone(), self.allocations.wait_for(&c.uid, deadline));
            }
        }

        let mut st = self.lock();
        let unprepared = st
            .waiting
            .remove(&ticket)
            .map(|w| w.unprepared)
            .unwrap_or_default();
        let mut out = BTreeMap::new();
        let mut plans: Vec<Plan> = Vec::new();
        let mut node_spec = NodeSpec::Unread;
        for c in claims {
            let named = Named::new(c.clone());
            if out.contains_key(&c.uid) || plans.iter().any(|p| p.uid == c.uid) {
                continue;
            }
            if !cdi::valid_uid(&c.uid) {
                out.insert(
                    c.uid.clone(),
                    Err(ClaimError::Config {
                        claim: named,
                        why: "the UID is not letters, digits and '-'".into(),
                    }),
                );
                continue;
            }
            if unprepared.contains(&c.uid) {
                tracing::info!(claim = %named, "unprepared while its prepare waited: not prepared");
                out.insert(c.uid.clone(), Err(ClaimError::Unprepared { claim: named }));
                continue;
            }
            if let Some(e) = st.checkpoint.claims.get(&c.uid)
                && e.state == EntryState::Prepared
                && !e.recovered
            {
                let answer = self.ensure_spec(&named, e).map(|()| e.prepared_devices());
                tracing::debug!(claim = %named, "prepare repeated: answered from the checkpoint");
                out.insert(c.uid.clone(), answer);
                continue;
            }
            // Not waited for above when it was prepared then; an unprepare
            // since (a race) leaves what the feed has now.
            let alloc = match allocations.get(&c.uid) {
                Some(a) => a.clone(),
                None => self.allocations.wait_for(&c.uid, Instant::now()),
            };
            match self.plan(&st, &named, alloc, &plans, &mut node_spec) {
                Ok((entry, mps_gpus, time_slice)) => plans.push(Plan {
                    uid: c.uid.clone(),
                    entry,
                    mps_gpus,
                    time_slice,
                }),
                Err(e) => {
                    tracing::warn!(claim = %named, error = %e, "prepare failed");
                    out.insert(c.uid.clone(), Err(e));
                }
            }
        }
        if plans.is_empty() {
            return out;
        }
        let Some(before) = self.begin_plans(&mut st, &plans, &mut out) else {
            return out;
        };
        // MPS daemons start, and time slices are set, outside the lock: one
        // may take seconds to answer, and `status` and other claims go on
        // meanwhile. Their claims are `preparing` in the checkpoint, so no
        // other claim takes their devices; an unprepare meanwhile stops the
        // daemon or sets the time slice back.
        let mut outside = Outside::default();
        if plans
            .iter()
            .any(|p| p.entry.mps.is_some() || p.slices().is_some())
        {
            drop(st);
            for p in &plans {
                let c = p.entry.claim_ref(&p.uid);
                if p.entry.mps.is_some() {
                    let r = self.start_mps(&c, &p.entry, &p.mps_gpus);
                    outside.started.insert(p.uid.clone(), r);
                }
                if let Some(rec) = p.slices() {
                    let r = self.apply_time_slice(&c, rec);
                    outside.sliced.insert(p.uid.clone(), r);
                }
            }
            st = self.lock();
        }
        self.write_plans(&mut st, &before, plans, outside, &mut out);
        out
    }

    /// Checks one claim against its allocation, the node's devices and the
    /// claims already prepared (and those planned in this batch), and
    /// builds its entry and spec.
    fn plan(
        &self,
        st: &State,
        named: &Named,
        alloc: Option<ClaimAllocation>,
        planned: &[Plan],
        node_spec: &mut NodeSpec,
    ) -> Result<(Entry, Vec<MpsGpu>, Option<TimeSliceRecord>), ClaimError> {
        let uid = &named.0.uid;
        let Some(alloc) = alloc else {
            return Err(ClaimError::NoAllocation {
                claim: named.clone(),
                waited_s: self.opts.allocation_wait.as_secs(),
            });
        };
        if alloc.devices.is_empty() {
            return Err(ClaimError::NoDevices {
                claim: named.clone(),
            });
        }
        let mut devices = BTreeMap::new();
        for d in &alloc.devices {
            if d.pool != self.opts.node_name {
                return Err(ClaimError::ForeignPool {
                    claim: named.clone(),
                    device: d.device.clone(),
                    pool: d.pool.clone(),
                    node: self.opts.node_name.clone(),
                });
            }
            let Some(dev) = st.devices.get(&d.device) else {
                let known: Vec<&str> = st.devices.keys().map(String::as_str).collect();
                return Err(ClaimError::UnknownDevice {
                    claim: named.clone(),
                    device: d.device.clone(),
                    known: if known.is_empty() {
                        "none".into()
                    } else {
                        known.join(", ")
                    },
                });
            };
            devices.insert(d.device.clone(), dev.clone());
        }
        let sharing = config::check(&alloc.configs).map_err(|why| ClaimError::Config {
            claim: named.clone(),
            why,
        })?;
        let mut time_slice = None;
        let (mps, mps_gpus) = match sharing {
            Sharing::Mps(settings) => {
                let gpus = self.mps_gpus(named, &alloc, &devices)?;
                let uuids: Vec<&str> = gpus.iter().map(|g| g.uuid.as_str()).collect();
                settings
                    .pinned_limits(&uuids)
                    .map_err(|why| ClaimError::Config {
                        claim: named.clone(),
                        why,
                    })?;
                (Some(settings), gpus)
            }
            Sharing::TimeSlicing { interval } => {
                time_slice = self.time_slice_plan(named, &alloc, &devices, interval)?;
                (None, Vec::new())
            }
            Sharing::None => (None, Vec::new()),
        };
        if let Some(rec) = &time_slice {
            let others = st
                .checkpoint
                .time_slices
                .iter()
                .map(|(u, r)| (u.as_str(), r))
                .chain(
                    planned
                        .iter()
                        .filter_map(|p| p.time_slice.as_ref().map(|r| (p.uid.as_str(), r))),
                )
                .filter(|(u, _)| *u != uid.as_str());
            if let Some((other, gpu, other_interval)) = timeslice::conflict(rec, others) {
                let other = st
                    .checkpoint
                    .claims
                    .get(other)
                    .map(|e| e.claim_ref(other))
                    .or_else(|| {
                        planned
                            .iter()
                            .find(|p| p.uid == other)
                            .map(|p| p.entry.claim_ref(other))
                    })
                    .unwrap_or_else(|| ClaimRef {
                        namespace: String::new(),
                        uid: other.to_string(),
                        name: String::new(),
                    });
                return Err(ClaimError::TimeSliceConflict {
                    claim: named.clone(),
                    interval: rec.interval.to_string(),
                    other: Named::new(other),
                    other_interval: other_interval.to_string(),
                    gpu,
                });
            }
        }
        let others = st
            .checkpoint
            .claims
            .iter()
            .map(|(u, e)| (u.as_str(), e))
            .chain(planned.iter().map(|p| (p.uid.as_str(), &p.entry)))
            .filter(|(u, _)| *u != uid.as_str());
        for (other_uid, other) in others {
            for d in &alloc.devices {
                let clash = other.devices.iter().find(|o| {
                    o.device == d.device && !(o.share_id.is_some() && d.share_id.is_some())
                });
                if clash.is_some() {
                    return Err(ClaimError::DeviceInUse {
                        claim: named.clone(),
                        device: d.device.clone(),
                        other: Named::new(other.claim_ref(other_uid)),
                    });
                }
            }
        }
        if let NodeSpec::Unread = node_spec {
            *node_spec = NodeSpec::Read(cdi::read_node_spec(&self.host, &self.opts.node_spec));
        }
        let NodeSpec::Read(read) = node_spec else {
            unreachable!("read just above")
        };
        let node = read.as_ref().map_err(|why| ClaimError::NodeSpec {
            claim: named.clone(),
            path: self.opts.node_spec.clone(),
            why: why.clone(),
        })?;
        let spec = cdi::claim_spec(named, node, &self.opts.node_spec, &devices)?;
        let missing = cdi::missing_device_nodes(&self.host, &spec);
        if !missing.is_empty() {
            return Err(ClaimError::MissingDeviceNodes {
                claim: named.clone(),
                missing,
            });
        }
        let entry = Entry {
            namespace: named.0.namespace.clone(),
            name: named.0.name.clone(),
            state: EntryState::Preparing,
            devices: alloc
                .devices
                .iter()
                .map(|d| EntryDevice {
                    request_names: vec![d.request.clone()],
                    pool: d.pool.clone(),
                    device: d.device.clone(),
                    share_id: d.share_id.clone(),
                    cdi_device_ids: vec![cdi::cdi_device_id(uid, &d.device)],
                })
                .collect(),
            spec,
            recovered: false,
            mps,
        };
        Ok((entry, mps_gpus, time_slice))
    }

    /// Checkpoint `preparing` for every plan; `None` (each plan answered
    /// with the error) when it cannot be written. Returns the checkpoint as
    /// it was before.
    fn begin_plans(
        &self,
        st: &mut State,
        plans: &[Plan],
        out: &mut BTreeMap<String, Result<Vec<PreparedDevice>, ClaimError>>,
    ) -> Option<Checkpoint> {
        let path = checkpoint::checkpoint_path(&self.opts.state_dir);
        let before = st.checkpoint.clone();
        for p in plans {
            st.checkpoint.claims.insert(p.uid.clone(), p.entry.clone());
            if let Some(rec) = &p.time_slice {
                st.checkpoint.time_slices.insert(p.uid.clone(), rec.clone());
            }
        }
        if let Err(e) = checkpoint::save(&self.host, &path, &st.checkpoint) {
            st.checkpoint = before;
            let why = write_why(e);
            for p in plans {
                let claim = Named::new(p.entry.claim_ref(&p.uid));
                tracing::warn!(claim = %claim, error = %why, "prepare failed: checkpoint");
                out.insert(p.uid.clone(), Err(checkpoint_error(claim, &path, &why)));
            }
            return None;
        }
        Some(before)
    }

    /// After [`begin_plans`](Self::begin_plans) (and the MPS daemons,
    /// `started`): the specs, checkpoint `prepared`; a claim whose step
    /// fails is rolled back and answered with the error.
    fn write_plans(
        &self,
        st: &mut State,
        before: &Checkpoint,
        plans: Vec<Plan>,
        mut outside: Outside,
        out: &mut BTreeMap<String, Result<Vec<PreparedDevice>, ClaimError>>,
    ) {
        let path = checkpoint::checkpoint_path(&self.opts.state_dir);
        let mut written = Vec::new();
        for mut p in plans {
            let claim = Named::new(p.entry.claim_ref(&p.uid));
            let started = &mut outside.started;
            if let Some(rec) = p.slices() {
                let r = outside.sliced.remove(&p.uid).unwrap_or_else(|| {
                    Err(ClaimError::TimeSlice {
                        claim: claim.clone(),
                        why: "not set".into(),
                    })
                });
                if !st.checkpoint.claims.contains_key(&p.uid) {
                    // Its unprepare set the GPUs back, perhaps before this
                    // prepare changed them: once more.
                    self.reset_after_failure(&st.checkpoint, &p.uid, &claim, rec);
                    out.insert(
                        p.uid,
                        Err(ClaimError::TimeSlice {
                            claim,
                            why: "the claim was unprepared while its GPUs' time slice was set"
                                .into(),
                        }),
                    );
                    continue;
                }
                if let Err(e) = r {
                    // A GPU before the one that failed may have changed.
                    self.undo(st, before, &p.uid, false);
                    self.reset_after_failure(&st.checkpoint, &p.uid, &claim, rec);
                    tracing::warn!(claim = %claim, error = %e, "prepare failed: time slice");
                    out.insert(p.uid, Err(e));
                    continue;
                }
            }
            if p.entry.mps.is_some() {
                let r = started.remove(&p.uid).unwrap_or_else(|| {
                    Err(ClaimError::Mps {
                        claim: claim.clone(),
                        why: "not started".into(),
                    })
                });
                if !st.checkpoint.claims.contains_key(&p.uid) {
                    if r.is_ok() {
                        self.stop_mps_after_failure(&claim, &p.entry);
                    }
                    out.insert(
                        p.uid,
                        Err(ClaimError::Mps {
                            claim,
                            why: "the claim was unprepared while its daemon started".into(),
                        }),
                    );
                    continue;
                }
                match r {
                    Ok(dirs) => {
                        super::mps::set_edits(&mut p.entry.spec, &dirs);
                        if let Some(e) = st.checkpoint.claims.get_mut(&p.uid) {
                            e.spec = p.entry.spec.clone();
                        }
                    }
                    Err(e) => {
                        self.undo(st, before, &p.uid, false);
                        tracing::warn!(claim = %claim, error = %e, "prepare failed: MPS");
                        out.insert(p.uid, Err(e));
                        continue;
                    }
                }
            }
            let spec_path = cdi::spec_path(&self.opts.cdi_dir, &p.uid);
            let yaml = cdi::to_yaml(&p.entry.spec);
            match self.host.write_atomic(&spec_path, yaml.as_bytes(), 0o644) {
                Ok(_) => written.push(p),
                Err(source) => {
                    // The old file, if any, is untouched (an atomic write).
                    self.stop_mps_after_failure(&claim, &p.entry);
                    self.undo(st, before, &p.uid, false);
                    if let Some(rec) = p.slices() {
                        self.reset_after_failure(&st.checkpoint, &p.uid, &claim, rec);
                    }
                    tracing::warn!(claim = %claim, path = %spec_path, error = %source, "prepare failed: spec");
                    out.insert(
                        p.uid,
                        Err(ClaimError::WriteSpec {
                            claim,
                            path: spec_path,
                            source,
                        }),
                    );
                }
            }
        }
        for p in &written {
            if let Some(e) = st.checkpoint.claims.get_mut(&p.uid) {
                e.state = EntryState::Prepared;
            }
        }
        if let Err(e) = checkpoint::save(&self.host, &path, &st.checkpoint) {
            // Not recorded as prepared: undo, so the kubelet's retry starts clean.
            let why = write_why(e);
            for p in written {
                let claim = Named::new(p.entry.claim_ref(&p.uid));
                self.stop_mps_after_failure(&claim, &p.entry);
                self.undo(st, before, &p.uid, true);
                if let Some(rec) = p.slices() {
                    self.reset_after_failure(&st.checkpoint, &p.uid, &claim, rec);
                }
                tracing::warn!(claim = %claim, error = %why, "prepare failed: checkpoint");
                out.insert(p.uid, Err(checkpoint_error(claim, &path, &why)));
            }
            let _ = checkpoint::save(&self.host, &path, &st.checkpoint);
            return;
        }
        for p in written {
            let claim = Named::new(p.entry.claim_ref(&p.uid));
            let devices: Vec<&str> = p.entry.devices.iter().map(|d| d.device.as_str()).collect();
            tracing::info!(claim = %claim, devices = ?devices, "claim prepared");
            out.insert(p.uid, Ok(p.entry.prepared_devices()));
        }
    }

    /// Undoes claim `uid`'s prepare after a failed step: a claim rebuilt
    /// from its spec before (and prepared again now) keeps that entry and
    /// its spec; any other loses its entry, and its spec when `written`.
    fn undo(&self, st: &mut State, before: &Checkpoint, uid: &str, written: bool) {
        match before.time_slices.get(uid) {
            Some(prev) => {
                st.checkpoint
                    .time_slices
                    .insert(uid.to_string(), prev.clone());
            }
            None => {
                st.checkpoint.time_slices.remove(uid);
            }
        }
        match before.claims.get(uid) {
            Some(prev) => {
                st.checkpoint.claims.insert(uid.to_string(), prev.clone());
            }
            None => {
                st.checkpoint.claims.remove(uid);
                if written {
                    let _ = self
                        .host
                        .remove_file(cdi::spec_path(&self.opts.cdi_dir, uid));
                }
            }
        }
    }

    /// A prepared claim's spec is on disk: written again when it is gone.
    fn ensure_spec(&self, claim: &Named, e: &Entry) -> Result<(), ClaimError> {
        let path = cdi::spec_path(&self.opts.cdi_dir, &claim.0.uid);
        if self.host.exists(&path) {
            return Ok(());
        }
        tracing::warn!(claim = %claim, path = %path, "the prepared claim's spec was gone: written again");
        self.host
            .write_atomic(&path, cdi::to_yaml(&e.spec).as_bytes(), 0o644)
            .map(|_| ())
            .map_err(|source| ClaimError::WriteSpec {
                claim: claim.clone(),
                path,
                source,
            })
    }

    pub(super) fn unprepare_batch(
        &self,
        claims: &[ClaimRef],
    ) -> BTreeMap<String, Result<(), ClaimError>> {
        let mut st = self.lock();
        for w in st.waiting.values_mut() {
            for c in claims.iter().filter(|c| w.uids.contains(&c.uid)) {
                w.unprepared.insert(c.uid.clone());
            }
        }
        let mut out = BTreeMap::new();
        let before = st.checkpoint.clone();
        let mut dropped = Vec::new();
        let mut reset = Vec::new();
        for c in claims {
            if !cdi::valid_uid(&c.uid) {
                // No file or entry can carry it: nothing to undo.
                out.insert(c.uid.clone(), Ok(()));
                continue;
            }
            if let Some(e) = st.checkpoint.claims.get(&c.uid) {
                // The daemon first: one that will not stop keeps the claim,
                // so the kubelet's retry finds it.
                if let Err(e) = self.stop_mps(c, e) {
                    tracing::warn!(claim = %Named::new(c.clone()), error = %e, "unprepare failed: MPS");
                    out.insert(c.uid.clone(), Err(e));
                    continue;
                }
            }
            // Its GPUs' time slice next: one not set back keeps the claim.
            if let Some(rec) = st.checkpoint.time_slices.get(&c.uid).cloned() {
                let named = Named::new(c.clone());
                if let Err(e) = self.reset_time_slice(&st.checkpoint, &c.uid, &named, &rec) {
                    tracing::warn!(claim = %named, error = %e, "unprepare failed: time slice");
                    out.insert(c.uid.clone(), Err(e));
                    continue;
                }
                st.checkpoint.time_slices.remove(&c.uid);
                reset.push(c.uid.clone());
            }
            if let Some(e) = st.checkpoint.claims.remove(&c.uid) {
                dropped.push((c.clone(), e.state));
            }
        }
        if !dropped.is_empty() || !reset.is_empty() {
            let path = checkpoint::checkpoint_path(&self.opts.state_dir);
            if let Err(e) = checkpoint::save(&self.host, &path, &st.checkpoint) {
                st.checkpoint = before;
                let why = write_why(e);
                let failed = claims.iter().filter(|c| {
                    dropped.iter().any(|(d, _)| d.uid == c.uid) || reset.contains(&c.uid)
                });
                for c in failed {
                    out.insert(
                        c.uid.clone(),
                        Err(checkpoint_error(Named::new(c.clone()), &path, &why)),
                    );
                }
            }
        }
        let pending: Vec<&ClaimRef> = claims
            .iter()
            .filter(|c| !out.contains_key(&c.uid))
            .collect();
        for c in pending {
            let named = Named::new(c.clone());
            let path = cdi::spec_path(&self.opts.cdi_dir, &c.uid);
            let result = match self.host.remove_file(&path) {
                Ok(_) => Ok(()),
                Err(source) => Err(ClaimError::RemoveSpec {
                    claim: named.clone(),
                    path,
                    source,
                }),
            };
            match dropped.iter().find(|(d, _)| d.uid == c.uid) {
                Some((_, state)) => {
                    tracing::info!(claim = %named, was = ?state, "claim unprepared")
                }
                None => tracing::debug!(claim = %named, "unprepare of a claim not prepared"),
            }
            out.insert(c.uid.clone(), result);
        }
        out
    }
}

fn checkpoint_error(claim: Named, path: &str, why: &str) -> ClaimError {
    ClaimError::Checkpoint {
        claim,
        path: path.to_string(),
        why: why.to_string(),
    }
}

/// What went wrong writing the checkpoint, without repeating its path.
fn write_why(e: super::error::StateError) -> String {
    match e {
        super::error::StateError::WriteCheckpoint { source, .. } => source.to_string(),
        other => other.to_string(),
    }
}
