//! One leader among the controller's replicas, through a
//! `coordination.k8s.io/v1` Lease. The leader renews the Lease every
//! [`Election::renew`]; a stand-by takes it over once it has not been
//! renewed for its `leaseDurationSeconds`. Every write is guarded by the
//! Lease's `resourceVersion`, so two replicas never both think they won.
//! Only the leader serves agents and writes to the API (its readiness says
//! so, and the Service sends agents to it); a replica that loses the Lease
//! closes every stream at once and its agents reconnect to the new leader,
//! which rebuilds the fleet from their snapshots.

use std::time::Duration;

use k8s_openapi::api::coordination::v1::{Lease, LeaseSpec};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{MicroTime, ObjectMeta};
use kube::api::{Api, PostParams};
use tokio::sync::watch;

/// The election's settings.
#[derive(Clone, Debug)]
pub struct Election {
    pub namespace: String,
    pub name: String,
    /// This replica's name (the pod's).
    pub identity: String,
    /// How long a Lease not renewed stays its holder's.
    pub duration: Duration,
    /// How often the leader renews, and a stand-by looks.
    pub renew: Duration,
}

impl Election {
    pub fn new(namespace: &str, identity: &str) -> Self {
        Election {
            namespace: namespace.into(),
            name: "gpu-controller".into(),
            identity: identity.into(),
            duration: Duration::from_secs(15),
            renew: Duration::from_secs(5),
        }
    }
}

/// What one look at the Lease found.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Outcome {
    /// This replica holds the Lease.
    Leader,
    /// Another replica holds it (its identity).
    Follower(String),
}

fn micro_now() -> MicroTime {
    MicroTime(jiff::Timestamp::now())
}

/// Looks at the Lease once: takes it if it is free or expired, renews it
/// if it is ours.
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
            jiff::Timestamp::now().as_second() > t.0.as_second() + held
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
        Err(kube::Error::Api(s)) if s.code == 409 => Ok(Outcome::Follower(holder)),
        Err(err) => Err(err),
    }
}

/// Keeps looking at the Lease; `leader` says whether this replica leads.
/// A leader that cannot renew within the Lease's duration steps down.
pub async fn run(client: kube::Client, e: Election, leader: watch::Sender<bool>) {
    let api: Api<Lease> = Api::namespaced(client, &e.namespace);
    let mut last_renewed: Option<tokio::time::Instant> = None;
    let mut said: Option<Outcome> = None;
    loop {
        match try_lead(&api, &e).await {
            Ok(o) => {
                if said.as_ref() != Some(&o) {
                    match &o {
                        Outcome::Leader => {
                            tracing::info!(lease = %e.name, identity = %e.identity, "leading")
                        }
                        Outcome::Follower(h) => {
                            tracing::info!(lease = %e.name, holder = %h, "standing by")
                        }
                    }
                    said = Some(o.clone());
                }
                let leads = o == Outcome::Leader;
                if leads {
                    last_renewed = Some(tokio::time::Instant::now());
                }
                leader.send_if_modified(|l| std::mem::replace(l, leads) != leads);
            }
            Err(err) => {
                tracing::warn!(lease = %e.name, error = %err, "cannot read or renew the Lease");
                said = None;
                // Before the Lease can expire for the others.
                let deadline = e.duration.saturating_sub(e.renew);
                if last_renewed.is_none_or(|t| t.elapsed() >= deadline) {
                    leader.send_if_modified(|l| std::mem::replace(l, false));
                }
            }
        }
        tokio::time::sleep(e.renew).await;
    }
}
