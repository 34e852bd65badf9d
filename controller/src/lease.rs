//! One leader among the controller's replicas, through a
//! `coordination.k8s.io/v1` Lease, as client-go's leader election keeps
//! one. The leader renews the Lease every [`Election::retry`]; a stand-by
//! looks as often and takes the Lease over once it has not been renewed
//! for its `leaseDurationSeconds` ([`Election::duration`]), or at once when
//! its holder is empty (given up). Every write is guarded by the Lease's
//! `resourceVersion`, so two replicas never both think they won.
//!
//! A leader that could not renew for [`Election::renew_deadline`] (shorter
//! than the duration) steps down before anyone else may take over. A
//! stopping leader steps down and gives the Lease up (holder cleared,
//! `leaseDurationSeconds` 1, as client-go's `ReleaseOnCancel` does), so the
//! stand-by takes over at its next look instead of waiting the Lease out.
//!
//! The timing (the defaults of [`Election::new`]): duration 10 s, renew
//! deadline 7 s, retry period 1 s. After a leader crashes, a stand-by leads
//! within duration + retry period (+ one round trip) of the leader's last
//! renewal: at most about 11 s after the crash (the README promises 15 s;
//! `controller/tests/lease.rs` measures it). After a release, within one
//! retry period: about a second at most.
//!
//! Only the leader serves agents and writes to the API; a replica that
//! stops leading closes every stream at once and its agents reconnect to
//! the new leader, which rebuilds the fleet from their snapshots. Why a
//! replica does not lead ([`Standing`]) is said by its `/readyz` and to the
//! agents it turns away.

use std::time::Duration;

use k8s_openapi::api::coordination::v1::{Lease, LeaseSpec};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{MicroTime, ObjectMeta};
use kube::api::{Api, PostParams};
use tokio::sync::{oneshot, watch};
use tokio::time::Instant;

use crate::error::{api_words as said, seconds};

/// The election's settings.
#[derive(Clone, Debug)]
pub struct Election {
    pub namespace: String,
    pub name: String,
    /// This replica's name (the pod's).
    pub identity: String,
    /// How long a Lease not renewed stays its holder's
    /// (`leaseDurationSeconds`, whole seconds).
    pub duration: Duration,
    /// A leader that could not renew for this long (counted from when its
    /// last successful renewal was sent) steps down. Shorter than
    /// `duration`, so it has stopped before anyone may take over.
    pub renew_deadline: Duration,
    /// How often the leader renews, and a stand-by looks.
    pub retry: Duration,
}

impl Election {
    pub fn new(namespace: &str, identity: &str) -> Self {
        Election {
            namespace: namespace.into(),
            name: "gpu-controller".into(),
            identity: identity.into(),
            duration: Duration::from_secs(10),
            renew_deadline: Duration::from_secs(7),
            retry: Duration::from_secs(1),
        }
    }

    /// `namespace/name`.
    pub fn lease(&self) -> String {
        format!("{}/{}", self.namespace, self.name)
    }
}

/// The client for the Lease's requests: `config`'s, without the retries
/// kube's client makes of a 429, 503 or 504 (for up to minutes): the
/// election looks again every retry period, and a leader must see an
/// outage, and step down, before its renew deadline.
pub fn client(mut config: kube::Config) -> Result<kube::Client, crate::error::ControllerError> {
    config.default_retry = false;
    kube::Client::try_from(config).map_err(|e| crate::error::ControllerError::Kube(e.to_string()))
}

/// What one look at the Lease found.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Outcome {
    /// This replica holds the Lease.
    Leader,
    /// Another replica holds it (its identity).
    Follower(String),
}

/// Where a replica stands, and why: what its `/readyz` says.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Standing {
    /// No election: this replica always leads.
    Alone,
    /// Not looked at the Lease yet.
    Starting,
    Leading,
    /// Another replica holds the Lease (its identity).
    Follower(String),
    /// The Lease could not be read or renewed (the error), so this replica
    /// does not lead; nothing is known of the others.
    NoApi(String),
    /// Stopping: the Lease is given up.
    Stopping,
}

impl Standing {
    /// Whether this replica leads.
    pub fn leads(&self) -> bool {
        matches!(self, Standing::Alone | Standing::Leading)
    }

    /// In words, for `/readyz` and the agents turned away (`lease`:
    /// `namespace/name`).
    pub fn words(&self, lease: &str) -> String {
        match self {
            Standing::Alone => "leading (no election)".into(),
            Standing::Leading => format!("leading: this replica holds the Lease {lease}"),
            Standing::Starting => format!("standing by: the Lease {lease} not looked at yet"),
            Standing::Follower(h) => {
                format!("standing by: another replica holds the Lease {lease} ({h})")
            }
            Standing::NoApi(e) => format!(
                "not leading: the Lease {lease} cannot be read or renewed (no replica can lead while the API server cannot be reached): {e}"
            ),
            Standing::Stopping if lease.is_empty() => "stopping".into(),
            Standing::Stopping => format!("stopping: the Lease {lease} given up"),
        }
    }
}

fn micro_now() -> MicroTime {
    MicroTime(jiff::Timestamp::now())
}

/// Looks at the Lease once: takes it if it is free (no holder), given up
/// or expired, renews it if it is ours.
pub async fn try_lead(api: &Api<Lease>, e: &Election) -> Result<Outcome, kube::Error> {
    let duration = e.duration.as_secs().max(1) as i32;
    let current = match api.get_opt(&e.name).await? {
        Some(l) => l,
        None => {
            let lease = Lease {
                metadata: ObjectMeta {
                    name: Some(e.name.clone()),
                    namespace: Some(e.namespace.clone()),
                    ..Default::default()
                },
                spec: Some(LeaseSpec {
                    holder_identity: Some(e.identity.clone()),
                    lease_duration_seconds: Some(duration),
                    acquire_time: Some(micro_now()),
                    renew_time: Some(micro_now()),
                    lease_transitions: Some(0),
                    ..Default::default()
                }),
            };
            return match api.create(&PostParams::default(), &lease).await {
                Ok(_) => Ok(Outcome::Leader),
                // Another replica made it first.
                Err(kube::Error::Api(s)) if s.code == 409 => {
                    Ok(Outcome::Follower("another replica".into()))
                }
                Err(err) => Err(err),
            };
        }
    };
    let spec = current.spec.clone().unwrap_or_default();
    let holder = spec.holder_identity.clone().unwrap_or_default();
    let mine = holder == e.identity;
    let expired = match &spec.renew_time {
        Some(t) => {
            let held = spec.lease_duration_seconds.unwrap_or(duration).max(1) as i64;
            let until = t.0.as_microsecond().saturating_add(held * 1_000_000);
            jiff::Timestamp::now().as_microsecond() > until
        }
        None => true,
    };
    if !mine && !expired && !holder.is_empty() {
        return Ok(Outcome::Follower(holder));
    }
    let mut next = current.clone();
    let s = next.spec.get_or_insert_with(Default::default);
    if !mine {
        s.holder_identity = Some(e.identity.clone());
        s.acquire_time = Some(micro_now());
        s.lease_transitions = Some(spec.lease_transitions.unwrap_or(0) + 1);
    }
    s.lease_duration_seconds = Some(duration);
    s.renew_time = Some(micro_now());
    // `replace` sends the resourceVersion read: a write in between is a 409.
    match api.replace(&e.name, &PostParams::default(), &next).await {
        Ok(_) => Ok(Outcome::Leader),
        Err(kube::Error::Api(s)) if s.code == 409 => Ok(Outcome::Follower(if holder.is_empty() {
            "another replica".into()
        } else {
            holder
        })),
        Err(err) => Err(err),
    }
}

/// Gives the Lease up if this replica holds it: the holder cleared,
/// `leaseDurationSeconds` 1, renew and acquire times now, the transitions
/// kept (client-go's release). Returns whether it was ours.
pub async fn release(api: &Api<Lease>, e: &Election) -> Result<bool, kube::Error> {
    let Some(current) = api.get_opt(&e.name).await? else {
        return Ok(false);
    };
    let spec = current.spec.clone().unwrap_or_default();
    if spec.holder_identity.as_deref() != Some(e.identity.as_str()) {
        return Ok(false);
    }
    let mut next = current;
    let s = next.spec.get_or_insert_with(Default::default);
    s.holder_identity = Some(String::new());
    s.lease_duration_seconds = Some(1);
    s.acquire_time = Some(micro_now());
    s.renew_time = Some(micro_now());
    match api.replace(&e.name, &PostParams::default(), &next).await {
        Ok(_) => Ok(true),
        // Written in between: no longer ours to give.
        Err(kube::Error::Api(s)) if s.code == 409 => Ok(false),
        Err(err) => Err(err),
    }
}

/// Keeps looking at the Lease; `leader` says whether this replica leads,
/// `standing` why. A leader that cannot renew within its renew deadline
/// steps down (a request still under way then is given up). When `stop`
/// fires (or its sender goes), this replica steps down, gives the Lease up
/// if it holds it, and returns.
pub async fn run(
    client: kube::Client,
    e: Election,
    leader: watch::Sender<bool>,
    standing: watch::Sender<Standing>,
    mut stop: oneshot::Receiver<()>,
) {
    let api: Api<Lease> = Api::namespaced(client, &e.namespace);
    let lease = e.lease();
    // When the last renewal that succeeded was sent.
    let mut renewed: Option<Instant> = None;
    let set = |s: Standing| {
        let leads = s.leads();
        standing.send_if_modified(|old| {
            if *old == s {
                return false;
            }
            match &s {
                Standing::Leading => {
                    tracing::info!(lease = %lease, identity = %e.identity, "leading")
                }
                Standing::Follower(h) => {
                    tracing::info!(lease = %lease, holder = %h, "standing by")
                }
                Standing::NoApi(err) => {
                    tracing::warn!(lease = %lease, error = %err, "not leading: the Lease cannot be read or renewed")
                }
                _ => {}
            }
            *old = s;
            true
        });
        leader.send_if_modified(|l| std::mem::replace(l, leads) != leads);
    };
    // The last error met, for the words when a leader steps down.
    let mut last_err = String::new();
    loop {
        // A leader past its deadline steps down before anyone may take
        // the Lease over.
        if let Some(t) = renewed
            && t.elapsed() >= e.renew_deadline
        {
            renewed = None;
            set(Standing::NoApi(format!(
                "not renewed for {}: {last_err}",
                seconds(e.renew_deadline)
            )));
        }
        let sent = Instant::now();
        // A leader gives its request up at its deadline; a stand-by's
        // request is given as long.
        let limit = match renewed {
            Some(t) => (t + e.renew_deadline).saturating_duration_since(sent),
            None => e.renew_deadline,
        };
        let look = tokio::select! {
            r = tokio::time::timeout(limit, try_lead(&api, &e)) => r,
            _ = &mut stop => break,
        };
        match look {
            Ok(Ok(Outcome::Leader)) => {
                renewed = Some(sent);
                set(Standing::Leading);
            }
            Ok(Ok(Outcome::Follower(h))) => {
                renewed = None;
                set(Standing::Follower(h));
            }
            failed => {
                last_err = match failed {
                    Ok(Err(err)) => said(&err),
                    _ => format!("the API server did not answer within {}", seconds(limit)),
                };
                if renewed.is_some() {
                    tracing::warn!(lease = %lease, error = %last_err, "cannot renew the Lease; leading until the renew deadline");
                } else {
                    set(Standing::NoApi(last_err.clone()));
                }
            }
        }
        let mut wake = Instant::now() + e.retry;
        if let Some(t) = renewed {
            wake = wake.min(t + e.renew_deadline);
        }
        tokio::select! {
            _ = tokio::time::sleep_until(wake) => {}
            _ = &mut stop => break,
        }
    }
    // Stopping: no more writes of ours, then the Lease given up (if it is
    // ours: a request given up on may have made it so), so the stand-by
    // need not wait it out.
    set(Standing::Stopping);
    let started = Instant::now();
    match tokio::time::timeout(e.retry, release(&api, &e)).await {
        Ok(Ok(true)) => {
            tracing::info!(lease = %lease, ms = started.elapsed().as_millis() as u64, "Lease given up")
        }
        Ok(Ok(false)) => {}
        Ok(Err(err)) => {
            tracing::warn!(lease = %lease, error = %said(&err), "cannot give the Lease up; a stand-by takes it once it expires")
        }
        Err(_) => tracing::warn!(
            lease = %lease,
            "the API server did not answer the Lease's release in time; a stand-by takes it once it expires"
        ),
    }
}
