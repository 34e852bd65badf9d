//! Writes what the fleet wants into the API server, and nothing else:
//!
//! - labels: server-side apply of `metadata.labels` under the field manager
//!   `gpu-controller` (labels it applied before and no longer sends are
//!   removed by the API server; labels of other managers are untouched),
//!   with the annotations of ours in the same apply (sharded: the agent's
//!   word on the driver rollout, `gpu-agent.io/agent-upgrade`);
//! - conditions: server-side apply of `status.conditions` (a map keyed by
//!   `type`: only our four types are ours), `lastTransitionTime` kept while
//!   the status stays, `lastHeartbeatTime` the time of the write;
//! - the health taint: `spec.taints` is an atomic list, so it is read,
//!   changed and written back with a merge patch carrying the
//!   `resourceVersion` it was read at (a conflict is read again).
//!
//! A node is written at most once per [`MIN_INTERVAL`]; changes meanwhile
//! are merged. A write sends only the requests whose content changed: an
//! unchanged node costs no request. What the API has is known from the
//! answers to these requests and from the watch of the nodes
//! ([`crate::drift`]): each is an [`Observed`], held against what the node
//! should carry by [`Fleet::look`].

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use k8s_openapi::api::core::v1::Node;
use kube::api::{Api, Patch, PatchParams};
use serde_json::json;

use crate::fleet::Fleet;
use crate::model::node::{
    Applied, Condition, Desired, FIELD_MANAGER, HEALTH_TAINT_EFFECT, HEALTH_TAINT_KEY,
    HEALTH_TAINT_VALUE, Observed, digest, read_applied,
};

/// A node is written at most this often.
pub const MIN_INTERVAL: Duration = Duration::from_secs(1);
/// Writes under way at once (over all nodes).
const CONCURRENT: usize = 32;
/// Tries of a taint change that meets a conflicting write.
const TAINT_TRIES: usize = 4;

/// A write that failed.
#[derive(Debug, thiserror::Error)]
pub enum WriteError {
    #[error("node {node}: no such node in the cluster")]
    NoNode { node: String },
    #[error("node {node}: {what}: {source}")]
    Api {
        node: String,
        what: &'static str,
        #[source]
        source: kube::Error,
    },
    #[error(
        "node {node}: the taint could not be written: the node kept changing ({TAINT_TRIES} conflicts)"
    )]
    Conflicts { node: String },
}

/// Writes that failed (for tests and, later, the controller's metrics).
#[derive(Debug, Default)]
pub struct Stats {
    pub failures: AtomicU64,
}

/// The writer.
#[derive(Debug)]
pub struct Writer {
    nodes: Api<Node>,
    pub stats: Stats,
    /// Whether this replica leads: a stand-by writes nothing.
    leader: Option<tokio::sync::watch::Receiver<bool>>,
}

fn now_rfc3339() -> String {
    jiff::Timestamp::from_second(jiff::Timestamp::now().as_second())
        .map(|t| t.to_string())
        .unwrap_or_default()
}

impl Writer {
    pub fn new(client: kube::Client) -> Self {
        Writer {
            nodes: Api::all(client),
            stats: Stats::default(),
            leader: None,
        }
    }

    /// Writes only while `leader` says this replica leads.
    pub fn with_leader(mut self, leader: tokio::sync::watch::Receiver<bool>) -> Self {
        self.leader = Some(leader);
        self
    }

    /// Writes the nodes the fleet queues, until the fleet is gone.
    pub async fn run(
        self: Arc<Self>,
        fleet: Arc<Fleet>,
        mut queue: tokio::sync::mpsc::UnboundedReceiver<String>,
    ) {
        let slots = Arc::new(tokio::sync::Semaphore::new(CONCURRENT));
        while let Some(node) = queue.recv().await {
            let Ok(slot) = slots.clone().acquire_owned().await else {
                return;
            };
            let w = self.clone();
            let f = fleet.clone();
            tokio::spawn(async move {
                w.write_node(&f, &node).await;
                drop(slot);
            });
        }
    }

    /// One node: wait out its interval, then write what differs.
    pub async fn write_node(&self, fleet: &Fleet, node: &str) {
        let last = fleet.with(node, |e| {
            e.write.in_queue = false;
            // Nothing known of the node since this controller started (a
            // state read back, a label watched, no snapshot yet) and its
            // agent not past its grace: writing would take away what it
            // said before.
            if e.write.writing || (!e.reported && e.gone.is_none()) {
                e.write.queued = false;
                return None;
            }
            e.write.writing = true;
            Some(e.write.last_write)
        });
        let Some(last) = last else {
            return;
        };
        if let Some(at) = last {
            tokio::time::sleep_until((at + MIN_INTERVAL).into()).await;
        }
        let applied = fleet.with(node, |e| {
            e.write.queued = false;
            e.write.applied.clone()
        });
        let desired = fleet.desired(node);
        let outcome = if self.leader.as_ref().is_some_and(|l| !*l.borrow()) || !fleet.owns(node) {
            tracing::debug!(node, "standing by: not written");
            Ok((applied.unwrap_or_default(), None))
        } else {
            self.write(node, &desired, applied).await
        };
        let again = fleet.with(node, |e| {
            e.write.writing = false;
            e.write.last_write = Some(Instant::now());
            let mut differs = false;
            match outcome {
                Ok((a, answer)) => {
                    e.write.applied = Some(a);
                    e.write.last_error = None;
                    // The last answer has the node as it is now, with
                    // what others wrote in between.
                    if let Some(seen) = answer {
                        differs |= fleet.look(node, e, seen);
                    }
                }
                Err(err) => {
                    tracing::warn!(node, error = %err, "cannot write the node");
                    self.stats.failures.fetch_add(1, Ordering::Relaxed);
                    e.write.last_error = Some(err.to_string());
                    // Read it afresh next time.
                    e.write.applied = None;
                }
            }
            // What the watch said meanwhile (older than the answer: nothing).
            if let Some(seen) = e.write.seen.take() {
                differs |= fleet.look(node, e, seen);
            }
            if differs {
                e.write.queued = true;
            }
            if e.write.queued && !e.write.in_queue {
                e.write.in_queue = true;
                true
            } else {
                false
            }
        });
        if again {
            fleet.requeue(node);
        }
    }

    /// Sends the requests that make the node carry `desired`; returns what
    /// it then carries, and the node as the last answer had it.
    async fn write(
        &self,
        node: &str,
        desired: &Desired,
        applied: Option<Applied>,
    ) -> Result<(Applied, Option<Observed>), WriteError> {
        let api_err = |what: &'static str| {
            move |source: kube::Error| match &source {
                kube::Error::Api(s) if s.code == 404 => WriteError::NoNode {
                    node: node.to_string(),
                },
                _ => WriteError::Api {
                    node: node.to_string(),
                    what,
                    source,
                },
            }
        };
        let mut answer: Option<Node> = None;
        let mut applied = match applied {
            Some(a) => a,
            None => {
                let n = self
                    .nodes
                    .get(node)
                    .await
                    .map_err(api_err("reading the node"))?;
                let a = read_applied(&n);
                answer = Some(n);
                a
            }
        };
        if !desired.keep_labels
            && (applied.labels != Some(digest(&desired.labels))
                || applied.annotations != Some(digest(&desired.annotations)))
        {
            let mut body = json!({
                "apiVersion": "v1",
                "kind": "Node",
                "metadata": { "name": node, "labels": desired.labels },
            });
            // Ours (sharded: the agent's word on the rollout) go with the
            // labels; one left out is taken off by the API server.
            if !desired.annotations.is_empty() {
                body["metadata"]["annotations"] = json!(desired.annotations);
            }
            answer = Some(
                self.nodes
                    .patch(
                        node,
                        &PatchParams::apply(FIELD_MANAGER).force(),
                        &Patch::Apply(&body),
                    )
                    .await
                    .map_err(api_err("applying the labels"))?,
            );
            tracing::info!(node, labels = desired.labels.len(), "labels applied");
            applied.labels = Some(digest(&desired.labels));
            applied.annotations = Some(digest(&desired.annotations));
        }
        let now = now_rfc3339();
        let conditions: Vec<(Condition, String)> = desired
            .conditions
            .iter()
            .map(|c| {
                let kept = applied
                    .conditions
                    .iter()
                    .flatten()
                    .find(|(o, _)| o.kind == c.kind && o.status == c.status);
                (
                    c.clone(),
                    kept.map(|(_, t)| t.clone()).unwrap_or_else(|| now.clone()),
                )
            })
            .collect();
        if applied.conditions.as_ref() != Some(&conditions) {
            let list: Vec<serde_json::Value> = conditions
                .iter()
                .map(|(c, t)| {
                    json!({
                        "type": c.kind,
                        "status": c.status,
                        "reason": c.reason,
                        "message": c.message,
                        // When this controller last said it (the write is
                        // its heartbeat: none while nothing changes).
                        "lastHeartbeatTime": now,
                        "lastTransitionTime": t,
                    })
                })
                .collect();
            let body = json!({
                "apiVersion": "v1",
                "kind": "Node",
                "metadata": { "name": node },
                "status": { "conditions": list },
            });
            answer = Some(
                self.nodes
                    .patch_status(
                        node,
                        &PatchParams::apply(FIELD_MANAGER).force(),
                        &Patch::Apply(&body),
                    )
                    .await
                    .map_err(api_err("applying the conditions"))?,
            );
            tracing::info!(node, "conditions applied");
            applied.conditions = Some(conditions);
        }
        if !desired.keep_taint && applied.taint != Some(desired.taint) {
            answer = Some(self.set_taint(node, desired.taint).await?);
            applied.taint = Some(desired.taint);
        }
        Ok((applied, answer.as_ref().map(Observed::of_node)))
    }

    /// Puts on or takes off the health taint, keeping every other taint;
    /// returns the node as the last answer had it.
    async fn set_taint(&self, node: &str, on: bool) -> Result<Node, WriteError> {
        for _ in 0..TAINT_TRIES {
            let n = self
                .nodes
                .get(node)
                .await
                .map_err(|source| WriteError::Api {
                    node: node.to_string(),
                    what: "reading the node's taints",
                    source,
                })?;
            let taints = n
                .spec
                .as_ref()
                .and_then(|s| s.taints.clone())
                .unwrap_or_default();
            let ours = |t: &k8s_openapi::api::core::v1::Taint| {
                t.key == HEALTH_TAINT_KEY && t.effect == HEALTH_TAINT_EFFECT
            };
            let has = taints.iter().any(ours);
            if has == on {
                return Ok(n);
            }
            let mut list: Vec<serde_json::Value> = taints
                .iter()
                .filter(|t| !ours(t))
                .map(|t| serde_json::to_value(t).unwrap_or_default())
                .collect();
            if on {
                list.push(json!({
                    "key": HEALTH_TAINT_KEY,
                    "value": HEALTH_TAINT_VALUE,
                    "effect": HEALTH_TAINT_EFFECT,
                    "timeAdded": now_rfc3339(),
                }));
            }
            let body = json!({
                "metadata": { "resourceVersion": n.metadata.resource_version },
                "spec": { "taints": list },
            });
            let params = PatchParams {
                field_manager: Some(FIELD_MANAGER.into()),
                ..Default::default()
            };
            match self.nodes.patch(node, &params, &Patch::Merge(&body)).await {
                Ok(n) => {
                    tracing::warn!(node, taint = %format!("{HEALTH_TAINT_KEY}={HEALTH_TAINT_VALUE}:{HEALTH_TAINT_EFFECT}"), on, "health taint changed");
                    return Ok(n);
                }
                Err(kube::Error::Api(s)) if s.code == 409 => continue,
                Err(source) => {
                    return Err(WriteError::Api {
                        node: node.to_string(),
                        what: "writing the taints",
                        source,
                    });
                }
            }
        }
        Err(WriteError::Conflicts {
            node: node.to_string(),
        })
    }
}
