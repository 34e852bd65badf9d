//! The fleet's nodes spread over the controller's replicas, through
//! `coordination.k8s.io/v1` Leases, as [`crate::lease`] elects one leader:
//! there are [`ShardConfig::count`] shard Leases `<prefix>-<k>`
//! (`k` = 0‥count) in one namespace, each held by at most one replica, and a
//! node belongs to shard [`shard_of`]`(node, count)`. Each replica also
//! renews a member Lease `<prefix>-member-<identity>` while it lives, so
//! every replica knows how many are alive and takes its fair share,
//! `ceil(count / live replicas)`, of the shards.
//!
//! Every Lease carries the label `gpu-agent.io/shards: <prefix>` ([`LABEL`]),
//! so one list call finds them all; a holder says where its agents reach it
//! in the annotation `gpu-agent.io/address` ([`ADDRESS`]), and carries on
//! each shard Lease what its caller says of that shard
//! ([`ShardConfig::summaries`], the annotation [`SUMMARY`]: the
//! ClusterPolicy's status, `model::policy_summary`), which the other
//! replicas read in [`ShardMap::summaries`]. Every write is
//! guarded by the Lease's `resourceVersion`; one that conflicts (409) means
//! another replica moved first, and this one looks again next round.
//!
//! One look every [`ShardConfig::retry`], nothing else:
//! 1. the list of the labelled Leases (live members: those whose
//!    `renewTime` + `leaseDurationSeconds` is to come, this one included);
//! 2. this replica's member Lease renewed (made if missing);
//! 3. each shard Lease it holds renewed; above its fair share it gives the
//!    extra ones up, highest first (holder cleared, `leaseDurationSeconds`
//!    1, as client-go's release), having stopped acting for them first;
//! 4. below its fair share it takes shards whose Lease is missing, given up
//!    or expired, lowest first;
//! 5. member Leases expired for [`FORGET_AFTER`] durations (replicas gone)
//!    and shard Leases at or past `count` that nobody holds are deleted.
//!
//! A shard whose renewal has not succeeded for
//! [`ShardConfig::renew_deadline`] (shorter than the duration) leaves
//! [`ShardMap::mine`] before anyone else may take it over, as a leader steps
//! down. A stopping replica stops acting for its shards, then gives them
//! and its member Lease up within [`STOP_WITHIN`], so the others take them
//! at their next look instead of waiting them out.
//!
//! With the defaults (duration 10 s, renew deadline 7 s, retry 1 s), a
//! replica that dies has its shards taken over within about 11 s of its
//! last renewal; one that stops, within a second. Every replica must be
//! given the same `count` (`shard_of` depends on it).
//!
//! It knows nothing of the fleet: what a replica does for the nodes of its
//! shards is its caller's, through the [`ShardMap`] watch.

use std::collections::{BTreeMap, BTreeSet};
use std::time::Duration;

use futures::future::join_all;
use k8s_openapi::api::coordination::v1::{Lease, LeaseSpec};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{MicroTime, ObjectMeta};
use kube::api::{Api, DeleteParams, ListParams, PostParams, Preconditions};
use tokio::sync::{oneshot, watch};
use tokio::time::Instant;

use crate::error::{api_words as said, seconds};
pub use crate::model::policy_summary::SUMMARY;

mod map;
use map::listed;
pub use map::{Holder, ShardMap, shard_of};

/// The label every shard and member Lease carries; its value is the prefix.
pub const LABEL: &str = "gpu-agent.io/shards";
/// The annotation with the holder's address (where agents reach it).
pub const ADDRESS: &str = "gpu-agent.io/address";
/// How long a stopping replica takes at most to give its Leases up.
pub const STOP_WITHIN: Duration = Duration::from_secs(2);
/// A member Lease expired for this many durations is deleted (its replica
/// is gone: pods' names change at each rollout).
pub const FORGET_AFTER: u32 = 6;

/// The sharding's settings.
#[derive(Clone, Debug)]
pub struct ShardConfig {
    pub namespace: String,
    /// The Leases' names begin with it (`gpu-controller-shard`).
    pub prefix: String,
    /// How many shards; the same for every replica.
    pub count: u32,
    /// This replica's name (the pod's).
    pub identity: String,
    /// Where agents reach this replica (`https://10.1.2.3:8443`).
    pub address: String,
    /// How long a Lease not renewed stays its holder's
    /// (`leaseDurationSeconds`, whole seconds).
    pub duration: Duration,
    /// A shard whose renewal has not succeeded for this long (counted from
    /// when the last one that did was sent) is no longer this replica's.
    /// Shorter than `duration`.
    pub renew_deadline: Duration,
    /// How often a replica looks.
    pub retry: Duration,
    /// What this replica says of each shard it holds: carried in the
    /// shard's Lease ([`SUMMARY`]) at each renewal (`None`, or a shard not
    /// in it: none).
    pub summaries: Option<watch::Receiver<BTreeMap<u32, String>>>,
}

impl ShardConfig {
    pub fn new(namespace: &str, identity: &str, address: &str, count: u32) -> Self {
        ShardConfig {
            namespace: namespace.into(),
            prefix: "gpu-controller-shard".into(),
            count: count.max(1),
            identity: identity.into(),
            address: address.into(),
            duration: Duration::from_secs(10),
            renew_deadline: Duration::from_secs(7),
            retry: Duration::from_secs(1),
            summaries: None,
        }
    }

    /// What this replica says of shard `k`, if anything.
    fn summary(&self, k: u32) -> Option<String> {
        self.summaries.as_ref()?.borrow().get(&k).cloned()
    }

    /// The shard Lease's name: `<prefix>-<k>`.
    pub fn shard_lease(&self, k: u32) -> String {
        format!("{}-{k}", self.prefix)
    }

    /// This replica's member Lease's name: `<prefix>-member-<identity>`.
    pub fn member_lease(&self) -> String {
        format!("{}-member-{}", self.prefix, self.identity)
    }

    /// The label selector that finds every Lease of this sharding.
    pub fn selector(&self) -> String {
        format!("{LABEL}={}", self.prefix)
    }

    /// The shard a Lease's name is of (`<prefix>-<k>`), if it is one.
    fn shard_in(&self, name: &str) -> Option<u32> {
        let k = name.strip_prefix(&self.prefix)?.strip_prefix('-')?;
        if k.is_empty() || !k.bytes().all(|b| b.is_ascii_digit()) {
            return None;
        }
        k.parse().ok()
    }
}

/// A request about the shards' Leases that failed, naming the Lease.
#[derive(Debug, thiserror::Error)]
pub enum ShardError {
    #[error("cannot list the Leases labelled {selector} in {namespace}: {}", said(.source))]
    List {
        namespace: String,
        selector: String,
        #[source]
        source: kube::Error,
    },
    #[error("cannot {what} the Lease {lease}: {}", said(.source))]
    Write {
        /// `create`, `renew`, `take`, `give up`, `delete`.
        what: &'static str,
        /// `namespace/name`.
        lease: String,
        #[source]
        source: kube::Error,
    },
}

fn micro_now() -> MicroTime {
    MicroTime(jiff::Timestamp::now())
}

fn holder(l: &Lease) -> &str {
    l.spec
        .as_ref()
        .and_then(|s| s.holder_identity.as_deref())
        .unwrap_or("")
}

/// When the Lease expires (µs since the epoch): its renewal plus its
/// duration; `None` when it was never renewed.
fn expiry(l: &Lease) -> Option<i64> {
    let s = l.spec.as_ref()?;
    let renewed = s.renew_time.as_ref()?.0.as_microsecond();
    let held = s.lease_duration_seconds.unwrap_or(1).max(1) as i64;
    Some(renewed.saturating_add(held * 1_000_000))
}

/// Whether nobody holds the Lease: its holder empty, or expired.
fn free(l: &Lease, now: i64) -> bool {
    holder(l).is_empty() || expiry(l).is_none_or(|until| now > until)
}

/// Whether a conflict (409) or a Lease gone meanwhile (404): another
/// replica moved first.
fn moved(err: &kube::Error) -> bool {
    matches!(err, kube::Error::Api(s) if s.code == 409 || s.code == 404)
}

/// A shard this replica holds: its Lease as last written, and when the
/// renewal that wrote it was sent.
struct Held {
    lease: Lease,
    renewed: Instant,
}

/// One replica's state between looks.
struct Shards {
    cfg: ShardConfig,
    api: Api<Lease>,
    held: BTreeMap<u32, Held>,
    /// Shards others hold, as the last list said, and what their holders
    /// say of them.
    others: BTreeMap<u32, Holder>,
    others_say: BTreeMap<u32, String>,
    replicas: usize,
}

impl Shards {
    fn lease_name(&self, name: &str) -> String {
        format!("{}/{name}", self.cfg.namespace)
    }

    fn write_err(&self, what: &'static str, name: &str, source: kube::Error) -> ShardError {
        ShardError::Write {
            what,
            lease: self.lease_name(name),
            source,
        }
    }

    /// The map as it stands now.
    fn map(&self) -> ShardMap {
        let mut holders: BTreeMap<u32, Holder> = self
            .others
            .iter()
            .filter(|(k, _)| !self.held.contains_key(k))
            .map(|(k, h)| (*k, h.clone()))
            .collect();
        for k in self.held.keys() {
            holders.insert(
                *k,
                Holder {
                    identity: self.cfg.identity.clone(),
                    address: self.cfg.address.clone(),
                },
            );
        }
        let summaries = self
            .others_say
            .iter()
            .filter(|(k, _)| {
                holders
                    .get(k)
                    .is_some_and(|h| h.identity != self.cfg.identity)
            })
            .map(|(k, s)| (*k, s.clone()))
            .collect();
        ShardMap {
            count: self.cfg.count,
            mine: self.held.keys().copied().collect(),
            holders,
            replicas: self.replicas,
            summaries,
        }
    }

    fn publish(&self, tx: &watch::Sender<ShardMap>) {
        let map = self.map();
        tx.send_if_modified(|old| {
            if *old == map {
                return false;
            }
            *old = map;
            true
        });
    }

    /// A new Lease of ours (a shard's or the member's), with `summary`.
    fn fresh(&self, name: &str, summary: Option<String>) -> Lease {
        let mut notes = BTreeMap::from([(ADDRESS.to_string(), self.cfg.address.clone())]);
        if let Some(s) = summary {
            notes.insert(SUMMARY.into(), s);
        }
        Lease {
            metadata: ObjectMeta {
                name: Some(name.into()),
                namespace: Some(self.cfg.namespace.clone()),
                labels: Some([(LABEL.to_string(), self.cfg.prefix.clone())].into()),
                annotations: Some(notes),
                ..Default::default()
            },
            spec: Some(LeaseSpec {
                holder_identity: Some(self.cfg.identity.clone()),
                lease_duration_seconds: Some(self.cfg.duration.as_secs().max(1) as i32),
                acquire_time: Some(micro_now()),
                renew_time: Some(micro_now()),
                lease_transitions: Some(0),
                ..Default::default()
            }),
        }
    }

    /// Makes the Lease ours (creates it if `current` is `None`), or renews
    /// it, carrying `summary` (`None`: a previous holder's taken off):
    /// `Ok(None)` when another replica moved first.
    async fn hold(
        &self,
        name: &str,
        current: Option<&Lease>,
        what: &'static str,
        summary: Option<String>,
    ) -> Result<Option<Lease>, ShardError> {
        let pp = PostParams::default();
        let written = match current {
            None => self.api.create(&pp, &self.fresh(name, summary)).await,
            Some(cur) => {
                let mut next = cur.clone();
                let labels = next.metadata.labels.get_or_insert_with(Default::default);
                labels.insert(LABEL.into(), self.cfg.prefix.clone());
                let notes = next
                    .metadata
                    .annotations
                    .get_or_insert_with(Default::default);
                notes.insert(ADDRESS.into(), self.cfg.address.clone());
                match summary {
                    Some(text) => notes.insert(SUMMARY.into(), text),
                    None => notes.remove(SUMMARY),
                };
                let s = next.spec.get_or_insert_with(Default::default);
                if s.holder_identity.as_deref() != Some(self.cfg.identity.as_str()) {
                    s.holder_identity = Some(self.cfg.identity.clone());
                    s.acquire_time = Some(micro_now());
                    s.lease_transitions = Some(s.lease_transitions.unwrap_or(0) + 1);
                }
                s.lease_duration_seconds = Some(self.cfg.duration.as_secs().max(1) as i32);
                s.renew_time = Some(micro_now());
                // `replace` sends the resourceVersion read: a write in
                // between is a 409.
                self.api.replace(name, &pp, &next).await
            }
        };
        match written {
            Ok(l) => Ok(Some(l)),
            Err(e) if moved(&e) => Ok(None),
            Err(e) => Err(self.write_err(what, name, e)),
        }
    }

    /// [`Shards::hold`] of each shard `ks` names, all at once.
    async fn hold_all(
        &self,
        ks: &[u32],
        shards: &BTreeMap<u32, Lease>,
        what: &'static str,
    ) -> Vec<Result<Option<Lease>, ShardError>> {
        join_all(ks.iter().map(|k| {
            let name = self.cfg.shard_lease(*k);
            let summary = self.cfg.summary(*k);
            async move { self.hold(&name, shards.get(k), what, summary).await }
        }))
        .await
    }

    /// Gives a Lease of ours up: holder cleared, `leaseDurationSeconds` 1,
    /// the address and summary taken off, the transitions kept (client-go's
    /// release).
    /// Returns whether it was given up (not written meanwhile).
    async fn give_up(&self, current: &Lease) -> Result<bool, ShardError> {
        let name = current.metadata.name.clone().unwrap_or_default();
        let mut next = current.clone();
        if let Some(notes) = next.metadata.annotations.as_mut() {
            notes.remove(ADDRESS);
            notes.remove(SUMMARY);
        }
        let s = next.spec.get_or_insert_with(Default::default);
        s.holder_identity = Some(String::new());
        s.lease_duration_seconds = Some(1);
        s.acquire_time = Some(micro_now());
        s.renew_time = Some(micro_now());
        match self.api.replace(&name, &PostParams::default(), &next).await {
            Ok(_) => Ok(true),
            Err(e) if moved(&e) => Ok(false),
            Err(e) => Err(self.write_err("give up", &name, e)),
        }
    }

    /// The Leases of this sharding.
    async fn list(&self) -> Result<Vec<Lease>, ShardError> {
        let lp = ListParams::default().labels(&self.cfg.selector());
        match self.api.list(&lp).await {
            Ok(l) => Ok(l.items),
            Err(source) => Err(ShardError::List {
                namespace: self.cfg.namespace.clone(),
                selector: self.cfg.selector(),
                source,
            }),
        }
    }

    /// One look: the list, the member Lease renewed, the shards renewed,
    /// given up or taken to this replica's fair share, the stale Leases
    /// deleted. What succeeded stays done when a later request fails (the
    /// first error is returned at the end) or the look is cut off.
    async fn look(&mut self, tx: &watch::Sender<ShardMap>) -> Result<(), ShardError> {
        let all = self.list().await?;
        let now = jiff::Timestamp::now().as_microsecond();
        let member = self.cfg.member_lease();
        let member_prefix = format!("{}-member-", self.cfg.prefix);
        let forget_us = FORGET_AFTER as i64 * self.cfg.duration.as_micros() as i64;
        let mut members = BTreeSet::from([self.cfg.identity.clone()]);
        let mut shards: BTreeMap<u32, Lease> = BTreeMap::new();
        let mut own_member = None;
        let mut stale = Vec::new();
        for l in all {
            let name = l.metadata.name.clone().unwrap_or_default();
            if name == member {
                own_member = Some(l);
            } else if name.starts_with(&member_prefix) {
                if !free(&l, now) {
                    members.insert(holder(&l).to_string());
                } else if expiry(&l).is_none_or(|until| now > until.saturating_add(forget_us)) {
                    stale.push(l);
                }
            } else if let Some(k) = self.cfg.shard_in(&name) {
                if k < self.cfg.count {
                    shards.insert(k, l);
                } else if free(&l, now) {
                    stale.push(l);
                }
            }
        }
        self.replicas = members.len();
        let count = self.cfg.count;
        let fair = count.div_ceil(self.replicas as u32) as usize;
        let mut first_err = None;

        // 1. This replica's member Lease.
        if let Err(e) = self.hold(&member, own_member.as_ref(), "renew", None).await {
            first_err.get_or_insert(e);
        }

        // 2. What the others hold; a shard of ours that another holds now
        //    (or whose Lease is gone) is no longer ours.
        let me = self.cfg.identity.clone();
        self.others = shards
            .iter()
            .filter(|(_, l)| !free(l, now) && holder(l) != me)
            .map(|(k, l)| {
                let address = l
                    .metadata
                    .annotations
                    .as_ref()
                    .and_then(|a| a.get(ADDRESS))
                    .cloned()
                    .unwrap_or_default();
                let identity = holder(l).to_string();
                (*k, Holder { identity, address })
            })
            .collect();
        self.others_say = self
            .others
            .keys()
            .filter_map(|k| {
                let notes = shards[k].metadata.annotations.as_ref()?;
                Some((*k, notes.get(SUMMARY)?.clone()))
            })
            .collect();
        let lost: Vec<u32> = self
            .held
            .keys()
            .filter(|k| shards.get(k).is_none_or(|l| holder(l) != me))
            .copied()
            .collect();
        if !lost.is_empty() {
            for k in &lost {
                self.held.remove(k);
            }
            tracing::info!(shards = %listed(&lost), replicas = self.replicas, "shards held by another replica now");
            self.publish(tx);
        }

        // 3. Above the fair share: the highest given up, having stopped
        //    acting for them first.
        let ours: Vec<u32> = shards
            .iter()
            .filter(|(_, l)| holder(l) == me)
            .map(|(k, _)| *k)
            .collect();
        let (keep, extra) = ours.split_at(ours.len().min(fair));
        if !extra.is_empty() {
            for k in extra {
                self.held.remove(k);
            }
            self.publish(tx);
            let given = join_all(extra.iter().map(|k| self.give_up(&shards[k]))).await;
            let mut gone = Vec::new();
            for (k, r) in extra.iter().zip(given) {
                match r {
                    Ok(true) => gone.push(*k),
                    Ok(false) => {}
                    Err(e) => {
                        first_err.get_or_insert(e);
                    }
                }
            }
            if !gone.is_empty() {
                tracing::info!(shards = %listed(&gone), replicas = self.replicas, why = "above the fair share", "shards given up");
            }
        }

        // 4. The rest renewed (or held again: ours in the API, dropped at
        //    the renew deadline, not taken by anyone since).
        let mut gained = Vec::new();
        let sent = Instant::now();
        let renewed = self.hold_all(keep, &shards, "renew").await;
        for (k, r) in keep.iter().zip(renewed) {
            match r {
                Ok(Some(lease)) => {
                    if self
                        .held
                        .insert(
                            *k,
                            Held {
                                lease,
                                renewed: sent,
                            },
                        )
                        .is_none()
                    {
                        gained.push(*k);
                    }
                }
                Ok(None) => {}
                Err(e) => {
                    first_err.get_or_insert(e);
                }
            }
        }

        // 5. Below the fair share: free shards taken, lowest first.
        let want: Vec<u32> = (0..count)
            .filter(|k| !ours.contains(k) && shards.get(k).is_none_or(|l| free(l, now)))
            .take(fair.saturating_sub(keep.len()))
            .collect();
        let sent = Instant::now();
        let taken = self.hold_all(&want, &shards, "take").await;
        for (k, r) in want.iter().zip(taken) {
            match r {
                Ok(Some(lease)) => {
                    self.held.insert(
                        *k,
                        Held {
                            lease,
                            renewed: sent,
                        },
                    );
                    gained.push(*k);
                }
                Ok(None) => {}
                Err(e) => {
                    first_err.get_or_insert(e);
                }
            }
        }
        if !gained.is_empty() {
            gained.sort_unstable();
            tracing::info!(shards = %listed(&gained), replicas = self.replicas, "shards taken");
        }
        self.publish(tx);

        // 6. Stale Leases deleted, at the version read (a replica that
        //    came back meanwhile keeps its own).
        for l in stale {
            let name = l.metadata.name.clone().unwrap_or_default();
            let dp = DeleteParams {
                preconditions: Some(Preconditions {
                    resource_version: l.metadata.resource_version.clone(),
                    uid: None,
                }),
                ..Default::default()
            };
            match self.api.delete(&name, &dp).await {
                Ok(_) => tracing::debug!(lease = %self.lease_name(&name), "stale Lease deleted"),
                Err(e) if moved(&e) => {}
                Err(e) => {
                    first_err.get_or_insert(self.write_err("delete", &name, e));
                }
            }
        }
        match first_err {
            Some(e) => Err(e),
            None => Ok(()),
        }
    }

    /// Drops the shards whose renewal has not succeeded for the renew
    /// deadline; returns them.
    fn drop_overdue(&mut self) -> Vec<u32> {
        let deadline = self.cfg.renew_deadline;
        let late: Vec<u32> = self
            .held
            .iter()
            .filter(|(_, h)| h.renewed.elapsed() >= deadline)
            .map(|(k, _)| *k)
            .collect();
        for k in &late {
            self.held.remove(k);
        }
        late
    }

    /// The earliest renew deadline of the shards held.
    fn next_deadline(&self) -> Option<Instant> {
        self.held
            .values()
            .map(|h| h.renewed + self.cfg.renew_deadline)
            .min()
    }

    /// Every Lease this replica holds in the API (its shards' and its
    /// member's) given up; when the list cannot be read, those it knows
    /// of. Returns the shards given up.
    async fn give_all_up(&self, known: Vec<Lease>) -> Result<Vec<u32>, ShardError> {
        let me = self.cfg.identity.as_str();
        let (leases, listed_err) = match self.list().await {
            Ok(all) => (all.into_iter().filter(|l| holder(l) == me).collect(), None),
            Err(e) => (known, Some(e)),
        };
        let given = join_all(leases.iter().map(|l| self.give_up(l))).await;
        let mut shards = Vec::new();
        let mut first_err = listed_err;
        for (l, r) in leases.iter().zip(given) {
            match r {
                Ok(true) => {
                    if let Some(k) = l
                        .metadata
                        .name
                        .as_deref()
                        .and_then(|n| self.cfg.shard_in(n))
                    {
                        shards.push(k);
                    }
                }
                Ok(false) => {}
                Err(e) => {
                    first_err.get_or_insert(e);
                }
            }
        }
        match first_err {
            Some(e) => Err(e),
            None => Ok(shards),
        }
    }
}

/// Keeps this replica's share of the shards: looks every
/// [`ShardConfig::retry`] and sends `tx` the [`ShardMap`] when it changed.
/// When `stop` fires (or its sender goes), this replica stops acting for
/// its shards (`mine` emptied and sent), gives them and its member Lease up
/// within [`STOP_WITHIN`], and returns.
pub async fn run(
    client: kube::Client,
    cfg: ShardConfig,
    tx: watch::Sender<ShardMap>,
    mut stop: oneshot::Receiver<()>,
) {
    let mut st = Shards {
        api: Api::namespaced(client, &cfg.namespace),
        held: BTreeMap::new(),
        others: BTreeMap::new(),
        others_say: BTreeMap::new(),
        replicas: 1,
        cfg,
    };
    let namespace = st.cfg.namespace.clone();
    let prefix = st.cfg.prefix.clone();
    // The error of the outage under way (said once), if one is.
    let mut failing: Option<String> = None;
    st.publish(&tx);
    loop {
        // Shards past their deadline are no longer ours, before anyone may
        // take them over.
        let late = st.drop_overdue();
        if !late.is_empty() {
            tracing::warn!(
                namespace = %namespace,
                prefix = %prefix,
                shards = %listed(&late),
                replicas = st.replicas,
                error = %failing.as_deref().unwrap_or("no renewal succeeded"),
                "shards dropped: their Leases not renewed within the renew deadline"
            );
            st.publish(&tx);
        }
        let started = Instant::now();
        let limit = match st.next_deadline() {
            Some(t) => t.saturating_duration_since(started),
            None => st.cfg.renew_deadline,
        };
        let look = tokio::select! {
            r = tokio::time::timeout(limit, st.look(&tx)) => r,
            _ = &mut stop => break,
        };
        let err = match look {
            Ok(Ok(())) => None,
            Ok(Err(e)) => Some(e.to_string()),
            Err(_) => Some(format!(
                "the API server did not answer within {}",
                seconds(limit)
            )),
        };
        match (err, failing.is_some()) {
            (None, true) => {
                failing = None;
                tracing::info!(namespace = %namespace, prefix = %prefix, "the shards' Leases can be read and renewed again");
            }
            (Some(e), false) => {
                tracing::warn!(namespace = %namespace, prefix = %prefix, error = %e, "cannot read or renew the shards' Leases");
                failing = Some(e);
            }
            (Some(e), true) => failing = Some(e),
            (None, false) => {}
        }
        st.publish(&tx);
        let mut wake = Instant::now() + st.cfg.retry;
        if let Some(t) = st.next_deadline() {
            wake = wake.min(t);
        }
        tokio::select! {
            _ = tokio::time::sleep_until(wake) => {}
            _ = &mut stop => break,
        }
    }
    // Stopping: no more acting for any shard, then every Lease of ours
    // given up, so the others need not wait them out.
    let known: Vec<Lease> = st.held.values().map(|h| h.lease.clone()).collect();
    st.held.clear();
    st.publish(&tx);
    let started = Instant::now();
    match tokio::time::timeout(STOP_WITHIN, st.give_all_up(known)).await {
        Ok(Ok(shards)) => {
            if !shards.is_empty() {
                tracing::info!(
                    shards = %listed(&shards),
                    replicas = st.replicas,
                    why = "stopping",
                    ms = started.elapsed().as_millis() as u64,
                    "shards given up"
                );
            }
        }
        Ok(Err(e)) => tracing::warn!(
            namespace = %namespace,
            prefix = %prefix,
            error = %e,
            "cannot give the shards' Leases up; other replicas take them once they expire"
        ),
        Err(_) => tracing::warn!(
            namespace = %namespace,
            prefix = %prefix,
            "the API server did not answer the shards' release in time; other replicas take them once they expire"
        ),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn shard_names_are_parsed_and_nothing_else() {
        let c = ShardConfig::new("ns", "a", "https://a:8443", 8);
        assert_eq!(c.shard_lease(3), "gpu-controller-shard-3");
        assert_eq!(c.shard_in("gpu-controller-shard-3"), Some(3));
        assert_eq!(c.shard_in("gpu-controller-shard-12"), Some(12));
        assert_eq!(c.shard_in("gpu-controller-shard-+3"), None);
        assert_eq!(c.shard_in("gpu-controller-shard-"), None);
        assert_eq!(c.shard_in("gpu-controller-shard-member-a"), None);
        assert_eq!(c.shard_in("gpu-controller-shard3"), None);
        assert_eq!(c.member_lease(), "gpu-controller-shard-member-a");
        assert_eq!(ShardConfig::new("ns", "a", "", 0).count, 1);
    }
}
