//! What the API has of the nodes, while this replica leads. Two things
//! depend on it:
//!
//! - **Drift.** A label of the controller's removed or changed by hand, its
//!   health taint taken off, one of its conditions overwritten, a Node
//!   deleted and registered again: each is a watch event, held against what
//!   the node's agent says ([`Fleet::look`]); what differs is written again
//!   with the writer's usual requests (labels and conditions by server-side
//!   apply under its field manager, the taint list at the resourceVersion
//!   read), so others' labels and taints stay. An event that changes nothing
//!   of the controller's (the kubelet's status, a user's own label) costs no
//!   request.
//! - **A new leader.** The controller keeps nothing on disk; the nodes it
//!   owns conditions on are the ones the API says carry them. Once the grace
//!   has passed since this replica took over, each of them whose agent has
//!   not connected to it is marked not reporting (an agent that went away
//!   while the leader changed is noticed by nobody else).
//!
//! The watch covers every node (a node made again has none of the labels a
//! selector would pick), lists them 500 a page, then follows from the
//! list's resourceVersion; it resumes from the last version it saw and
//! lists again only when that is too old. Only the labels, the taints and
//! the conditions of each Node are read ([`NodeView`]: the images, addresses
//! and the rest of the object are skipped, not kept). It runs only while
//! this replica leads: a stand-by asks the API nothing about nodes.

use std::borrow::Cow;
use std::sync::Arc;

use futures::StreamExt;
use k8s_openapi::api::core::v1::{NodeCondition, Taint};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;
use kube::api::Api;
use kube::runtime::watcher::{self, Event};
use serde::Deserialize;

use crate::fleet::Fleet;
use crate::model::node::Observed;

/// A Node as far as the controller reads it.
#[derive(Clone, Debug, Deserialize)]
pub struct NodeView {
    pub metadata: ObjectMeta,
    #[serde(default)]
    pub spec: Option<SpecView>,
    #[serde(default)]
    pub status: Option<StatusView>,
}

#[derive(Clone, Debug, Default, Deserialize)]
pub struct SpecView {
    #[serde(default)]
    pub taints: Option<Vec<Taint>>,
}

#[derive(Clone, Debug, Default, Deserialize)]
pub struct StatusView {
    #[serde(default)]
    pub conditions: Option<Vec<NodeCondition>>,
}

impl NodeView {
    pub fn observed(&self) -> Observed {
        Observed::of(
            &self.metadata,
            self.spec.as_ref().and_then(|s| s.taints.as_deref()),
            self.status.as_ref().and_then(|s| s.conditions.as_deref()),
        )
    }
}

impl kube::Resource for NodeView {
    type DynamicType = ();
    type Scope = k8s_openapi::ClusterResourceScope;

    fn kind(_: &()) -> Cow<'_, str> {
        "Node".into()
    }
    fn group(_: &()) -> Cow<'_, str> {
        "".into()
    }
    fn version(_: &()) -> Cow<'_, str> {
        "v1".into()
    }
    fn plural(_: &()) -> Cow<'_, str> {
        "nodes".into()
    }
    fn meta(&self) -> &ObjectMeta {
        &self.metadata
    }
    fn meta_mut(&mut self) -> &mut ObjectMeta {
        &mut self.metadata
    }
}

fn now_rfc3339() -> String {
    jiff::Timestamp::from_second(jiff::Timestamp::now().as_second())
        .map(|t| t.to_string())
        .unwrap_or_default()
}

/// Follows the nodes while this replica leads (again from the start each
/// time it takes over). A leadership channel that closes keeps its last
/// word (with no election, its sender may be gone from the start).
pub async fn run(
    client: kube::Client,
    fleet: Arc<Fleet>,
    mut leader: tokio::sync::watch::Receiver<bool>,
) {
    loop {
        if leader.wait_for(|l| *l).await.is_err() {
            return;
        }
        let took_over = tokio::time::Instant::now();
        let at = now_rfc3339();
        tokio::select! {
            _ = follow(client.clone(), &fleet, took_over, &at) => return,
            _ = async {
                if leader.wait_for(|l| !*l).await.is_err() {
                    std::future::pending::<()>().await;
                }
            } => {}
        }
    }
}

async fn follow(client: kube::Client, fleet: &Fleet, took_over: tokio::time::Instant, at: &str) {
    let api: Api<NodeView> = Api::all(client);
    let why = format!("no stream to the leading gpu-controller since it took over at {at}");
    let deadline = took_over + fleet.grace;
    let mut stream = std::pin::pin!(kube::runtime::WatchStreamExt::default_backoff(
        watcher::watcher(api, watcher::Config::default())
    ));
    // The first list is in; the grace since the takeover has run out.
    let (mut listed, mut swept, mut failing) = (false, false, false);
    loop {
        tokio::select! {
            ev = stream.next() => {
                let Some(ev) = ev else { return };
                match ev {
                    Ok(Event::Apply(n) | Event::InitApply(n)) => {
                        failing = false;
                        let Some(name) = n.metadata.name.clone() else {
                            continue;
                        };
                        let seen = n.observed();
                        // Sharded: what it carries of the driver rollout,
                        // whoever holds it (the leader plans from it).
                        fleet.note_rollout(&name, &seen);
                        // Another replica's shard: its to follow.
                        if !fleet.owns(&name) {
                            continue;
                        }
                        fleet.observe(&name, seen);
                        if swept {
                            fleet.mark_unconnected(Some(&name), &why);
                        }
                    }
                    Ok(Event::Delete(n)) => {
                        if let Some(name) = &n.metadata.name {
                            fleet.forget_in_api(name);
                        }
                    }
                    Ok(Event::Init) => {}
                    Ok(Event::InitDone) => {
                        if !listed {
                            tracing::info!(
                                after_ms = took_over.elapsed().as_millis() as u64,
                                "nodes listed: following them"
                            );
                        }
                        listed = true;
                    }
                    Err(e) => {
                        if !failing {
                            tracing::warn!(error = %e, "cannot watch the nodes: what is changed in the API is not repaired meanwhile");
                        }
                        failing = true;
                    }
                }
            }
            _ = tokio::time::sleep_until(deadline), if listed && !swept => {
                swept = true;
                let marked = fleet.mark_unconnected(None, &why);
                tracing::info!(
                    marked,
                    grace_s = fleet.grace.as_secs(),
                    "grace since the takeover over: nodes whose agent did not connect are not reporting"
                );
            }
        }
    }
}
